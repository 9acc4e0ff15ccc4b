"""`rlx serve`: an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions) on localhost backed by an
rlx rollout engine. Options other than the model, port and output are RolloutConfig's sampling and engine fields."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.commands._options import config_command
from rlx.serve.config import ServeConfig


@config_command(
    ServeConfig,
    "serve",
    # rollout-only settings: the prompts, the group size and the episode drivers come from the clients
    exclude=(
        "weight_sync",
        "sync_bucket_mib",
        "sleep",
        "n",
        "env",
        "agent",
        "max_turns",
        "on_env_error",
        "env_timeout_s",
        "env_workers",
        "agent_timeout_s",
        "verifiers",
        "openai_agents",
        "batch_size",
        "remax_baseline",
        "chat_template",
        # the prompts' own limits and filter (a client's context is checked against --max-total-tokens), the
        # training side of vision models, and tensor parallelism (rlx serve is one process)
        "max_prompt_length",
        "on_long_prompt",
        "max_prompt_tokens",
        "freeze_vision_tower",
        "store_pixels",
        "tp_degree",
        "tp",
    ),  # fmt: skip
    metavars={"engine": "NAME"},
)
def serve(
    cfg: ServeConfig,
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model: a Hugging Face dir, an rlx checkpoint dir or a .gguf file.")
    ],
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one; the URL is printed).")] = 8000,
    out: Annotated[
        str | None,
        typer.Option(metavar="FILE", help="On exit, write every sample's token-exact trajectory as rollouts.jsonl."),
    ] = None,
    max_requests: Annotated[
        int,
        typer.Option(
            help="Stop after this many answered generation requests (0 = run until "
            "interrupted); health checks, /v1/models and refused (4xx) requests do not count."
        ),
    ] = 0,
    served_name: Annotated[str, typer.Option(help="The model name /v1/models reports and replies carry.")] = "rlx",
) -> None:
    """Serve a model over HTTP as OpenAI's API does, with continuous batching over concurrent requests.

    Every request made to /s/SAMPLE_ID/v1 (or with an X-Session-ID header) belongs to that sample's trajectory
    (otherwise the sample 'default'): a chat request extending the previous one continues it token-exactly, a
    rewritten history starts a new segment. Point an OpenAI client at it (base_url=http://127.0.0.1:PORT/v1).
    Stops on Ctrl-C or SIGTERM (exit 143), writing --out first. See docs/serve.md.
    """
    with reporting("serve"):
        from rlx.stages.serve import run_serve

        run_serve(cfg, model, port, out, max_requests=max_requests, name=served_name)
