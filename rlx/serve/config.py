"""Settings of the OpenAI-compatible endpoint itself (listening, limits, sessions, images); no torch import.

`EndpointConfig` is what `AgentServer` takes; `ServeConfig` is `rlx serve`'s whole config: the rollout engine and
sampling settings (RolloutConfig) plus an `endpoint` table whose fields are flat flags (`--api-key`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlx.config import check
from rlx.rollout.config import RolloutConfig


@dataclass(kw_only=True)
class EndpointConfig:
    """How the endpoint listens and what it accepts from clients."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default; another address exposes the model to that network)."""
    api_key: str = ""
    """When set, every request must carry `Authorization: Bearer <api_key>` (else HTTP 401); empty = no check."""
    max_request_mib: float = 8.0
    """Largest request body in MiB (larger ones get HTTP 413 before they are read whole)."""
    image_root: str = ""
    """Folder whose files clients may name as images (local paths or file:// URLs, resolved, never leaving it);
    empty = clients send images as data: URIs only."""
    max_image_mib: float = 32.0
    """Largest image file read for a request, in MiB."""
    session_idle_s: float = 1800.0
    """A session (sample) untouched this long is closed and kept as a finished record (0 = never)."""
    max_sessions: int = 10000
    """Most open sessions; past it the longest idle one is closed and kept as a finished record (0 = no cap)."""
    backlog: int = 4096
    """Listen backlog: connections the kernel queues before the server accepts them (at least 2048)."""

    def __post_init__(self) -> None:
        check(bool(self.host), "host", "must not be empty")
        check(self.max_request_mib > 0, "max_request_mib", f"must be > 0, got {self.max_request_mib}")
        check(self.max_image_mib > 0, "max_image_mib", f"must be > 0, got {self.max_image_mib}")
        check(self.session_idle_s >= 0, "session_idle_s", f"must be >= 0, got {self.session_idle_s}")
        check(self.max_sessions >= 0, "max_sessions", f"must be >= 0, got {self.max_sessions}")
        check(self.backlog >= 2048, "backlog", f"must be at least 2048, got {self.backlog}")
        check(all(c.isprintable() and c != " " for c in self.api_key), "api_key", "must be printable, without spaces")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * 2**20)

    @property
    def max_image_bytes(self) -> int:
        return int(self.max_image_mib * 2**20)


@dataclass(kw_only=True)
class ServeConfig(RolloutConfig):
    """`rlx serve`: the engine and sampling settings of a rollout, and the endpoint's own."""

    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """Listening, limits, sessions and images (flat flags: --api-key, --max-request-mib, --image-root, ...)."""
