"""A task that needs a tool: products and sums of multi-digit numbers, with a calculator the model may call.

    python -m rlx.tasks.calculator --out prompts.jsonl --num 1000 --digits 3 --ops '*'
    python -m rlx.tasks.calculator --demos --out demos.jsonl --num 1000 --seed 1 --exclude prompts.jsonl  # for rlx sft
    python -m rlx.tasks.calculator --demos --echo --tool-fraction 0.3 ...  # 30% call the tool, 70% guess wrong
    python -m rlx.tasks.calculator --demos --bound --tool-fraction 0.3 ...  # calls without arguments
    python -m rlx.tasks.calculator --demos --choice --tool-fraction 0.5 ...  # half call the right tool, half the other

A tiny model cannot multiply 3-digit numbers in its head, but it can learn to call the calculator
and copy the result. `CalculatorEnv` is the environment (`--env rlx.tasks.calculator:CalculatorEnv`):
it offers one tool, `calculator(expression)`, answers each call with the value, and ends the episode
at the first assistant message without a tool call, rewarding 1 when its last integer is the answer.
`score` is the same check as a rule reward (`--reward rlx.tasks.calculator:score`). `EchoCalculatorEnv`
(`--demos --echo` for its solved episodes) is the same task with a tool that replies "12*34=408";
`QuestionCalculatorEnv` (`--demos --bound`) is that with the expression optional: a call without one
computes the episode's own question. `ToolChoiceCalculatorEnv` (`--demos --choice`) offers two tools bound to the
question, `multiply` and `add`: the task is to pick the one matching its operator and copy the reply.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from pathlib import Path

from rlx.utils.io import write_jsonl

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
QUESTION_CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        **CALCULATOR_TOOL["function"],
        "description": "Evaluate an arithmetic expression; without one, the question asked",
        "parameters": {**CALCULATOR_TOOL["function"]["parameters"], "required": []},
    },
}
BOUND_TOOLS = {"multiply": "*", "add": "+"}
"""ToolChoiceCalculatorEnv's tools: each applies its operator to the question's two numbers."""


def _bound_tool(name: str, op: str) -> dict:
    """QUESTION_CALCULATOR_TOOL as one operator bound to the question: no arguments (the template lists `add()`)."""
    function = QUESTION_CALCULATOR_TOOL["function"]
    return {
        **QUESTION_CALCULATOR_TOOL,
        "function": {
            **function,
            "name": name,
            "description": f"The question's two numbers joined by {op}, evaluated",
            "parameters": {**function["parameters"], "properties": {}},
        },
    }


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_MAX_DIGITS = 60
_INTEGER = re.compile(r"-?\d+")
_OPERATION = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")  # "59*63": 59, *, 63


def generate_calculator(
    num: int, seed: int = 0, digits: int = 3, ops: str = "*", id_prefix: str = "calc"
) -> list[dict]:
    """`num` prompt records {id, prompt: "123*456", data_source: 'calculator', ground_truth}, deterministic."""
    unknown = set(ops) - set(OPS)
    if unknown or not ops:
        raise ValueError(f"ops must be made of {''.join(OPS)}, got {ops!r}")
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    width = len(str(num - 1))
    records = []
    for i in range(num):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(ops)
        records.append(
            {
                "id": f"{id_prefix}-{i:0{width}d}",
                "prompt": f"{a}{op}{b}",
                "data_source": "calculator",
                "ground_truth": str(OPS[op](a, b)),
            }
        )
    return records


def evaluate(expression: str) -> int:
    """The integer value of + - * // and parentheses over integers; ValueError for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError("the result is too large")
        return value
    raise ValueError("only integers, + - * // and parentheses are allowed")


def last_integer(text: str) -> str | None:
    found = _INTEGER.findall(text or "")
    return found[-1] if found else None


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the last integer of the answer is the ground truth, else 0.0 (verl's reward signature)."""
    return 1.0 if last_integer(solution_str) == str(ground_truth) else 0.0


class CalculatorEnv:
    """One question; the calculator tool answers each call; the first reply without a call is graded."""

    tools = [CALCULATOR_TOOL]

    def __init__(self, record: dict):
        prompt = record["prompt"]
        self.opening = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        self.question = self.opening[-1]["content"]
        self.answer = str(record["ground_truth"])

    def reset(self) -> list[dict]:
        """The prompt's messages (a system message explaining the tool is kept), or the question as a user turn."""
        return [dict(m) for m in self.opening]

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        calls = message.get("tool_calls") or []
        if not calls:
            return [], score("calculator", message.get("content", ""), self.answer), True
        return [{"role": "tool", "tool_call_id": call["id"], "content": self.call(call)} for call in calls], 0.0, False

    echo = False
    """Whether the tool's reply restates the expression ("59*63=3717") rather than giving the value alone."""

    @classmethod
    def call(cls, call: dict) -> str:
        """The tool's reply to one OpenAI-format call: the value (after the expression, without its spaces, and
        '=' when `echo`), or an error the model can read."""
        function = call.get("function", {})
        if function.get("name") != "calculator":
            return f"error: unknown tool {function.get('name')!r}"
        try:
            arguments = json.loads(function.get("arguments") or "{}")
            expression = str(arguments["expression"])
            value = str(evaluate(expression))
        except (ValueError, KeyError, TypeError) as e:
            return f"error: {e}"
        return f"{''.join(expression.split())}={value}" if cls.echo else value


class EchoCalculatorEnv(CalculatorEnv):
    """CalculatorEnv whose calculator restates the expression, as a calculator's tape does: "59*63=3717".

    For tiny models trained from scratch (recipes/calculator.toml): a character-level 2-layer model copies
    a number's later digits by matching the digit before each, but finds no match for the first digit of a
    bare "3717" and guesses it; after "=" it has one. Solved episodes (`demonstration(record, echo=True)`)
    answer with the tool's reply, e.g. "59*63=3717", whose last integer is graded.
    """

    echo = True


class QuestionCalculatorEnv(EchoCalculatorEnv):
    """EchoCalculatorEnv whose expression is optional: a call without one (`"arguments": {}`) computes the
    episode's own question, like a look-up tool bound to the task, and replies "59*63=3717".

    For tiny models trained from scratch (recipes/calculator.toml): a 2-layer character model learns to copy the
    tool's reply after "=" but, seed by seed, not to copy the question into the call's arguments; with the
    argument optional, calling is one decision (`<tool_call>` or an answer) that RL can settle.
    """

    tools = [QUESTION_CALCULATOR_TOOL]

    def call(self, call: dict) -> str:
        """The echo reply to `call`; with no expression (no arguments, or `{}`) that of the episode's question."""
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict) and "expression" not in arguments:
            function = {**function, "arguments": json.dumps({"expression": self.question})}
            call = {**call, "function": function}
        return EchoCalculatorEnv.call(call)


class ToolChoiceCalculatorEnv(EchoCalculatorEnv):
    """EchoCalculatorEnv with two tools bound to the question in place of the calculator: `multiply` replies
    "59*63=3717" and `add` "59+63=122" for the question "59*63" (any arguments are ignored).

    For tiny models trained from scratch (recipes/calculator.toml): the demonstrations (`--demos --choice`) call one of
    the two at random and answer with its reply, so that every one of them trains the copy of the reply (which RL
    did not keep sharp when only the calling half of the demonstrations trained it, QuestionCalculatorEnv), and
    what SFT leaves open is a single choice, the tool's first letter, for RL to settle.
    """

    tools = [_bound_tool(name, op) for name, op in BOUND_TOOLS.items()]

    def call(self, call: dict) -> str:
        """The echo reply of the called tool's operator applied to the question's two numbers."""
        name = call.get("function", {}).get("name")
        if name not in BOUND_TOOLS:
            return f"error: unknown tool {name!r}"
        operation = _OPERATION.fullmatch(self.question)
        if not operation:
            return f"error: the question {self.question!r} is not two numbers and an operator"
        expression = f"{operation[1]}{BOUND_TOOLS[name]}{operation[3]}"
        function = {"name": "calculator", "arguments": json.dumps({"expression": expression})}
        return EchoCalculatorEnv.call({**call, "function": function})

    def right_tool(self) -> str | None:
        """The tool whose operator is the question's (None when neither is)."""
        operation = _OPERATION.fullmatch(self.question)
        return next((name for name, op in BOUND_TOOLS.items() if operation and op == operation[2]), None)


SYSTEM = (
    "You have a calculator tool. To use it, reply with only "
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call> '
    "(your expression in place of 12*34); its result comes back to you. Then reply with the final answer, "
    "a single number."
)
"""The system message of --style chat prompts (for models whose chat template does not list tools)."""


def chat_prompt(question: str) -> list[dict]:
    """The opening messages of a --style chat prompt: `SYSTEM`, then the question as a user message."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def question_of(prompt) -> str:
    """The question of a prompt record's `prompt`: the text, or the last message's content (--style chat)."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def generate_demonstrations(
    num: int,
    seed: int = 1,
    digits: int = 3,
    ops: str = "*",
    exclude=(),
    echo: bool = False,
    tool_fraction: float = 1.0,
    bound: bool = False,
    choice: bool = False,
    style: str = "text",
) -> list[dict]:
    """`num` solved episodes (`demonstration`) of questions not in `exclude` (e.g. the RL prompts), deterministic;
    `echo`: of EchoCalculatorEnv. `tool_fraction` < 1: only that share of the episodes (drawn at random, about
    `tool_fraction * num`) calls the tool; the others answer at once with a wrong guess (`guessed_demonstration`),
    so a policy fine-tuned on them calls the tool about as often, a decision left for RL to settle. `bound`: of
    QuestionCalculatorEnv, the calls without arguments (implies the echo). `choice`: of ToolChoiceCalculatorEnv, every
    episode calls a tool and answers with its reply; `tool_fraction` is then the share calling the right one, the
    others call the other tool (and answer wrong): every episode trains the copy of the reply. `style` 'chat': the
    episodes of --style chat prompts (`SYSTEM` first), the call written as text in the form `SYSTEM` shows (for
    chat templates that do not write tool calls, e.g. SmolLM2's: see `demonstration`)."""
    if style not in ("text", "chat"):
        raise ValueError(f"style must be 'text' or 'chat', got {style!r}")
    if style == "chat" and (echo or bound or choice):
        raise ValueError("style 'chat' goes with the plain calculator (no echo, bound or choice)")
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    if choice and set(ops) - set(BOUND_TOOLS.values()):
        raise ValueError(f"choice: ops must be made of {''.join(BOUND_TOOLS.values())}, got {ops!r}")
    held_out = {str(q) for q in exclude}
    pool = generate_calculator(4 * num + len(held_out), seed, digits, ops, id_prefix="demo")
    records = [r for r in pool if r["prompt"] not in held_out][:num]
    if len(records) < num:
        raise ValueError(f"cannot draw {num} questions of {digits} digits apart from the {len(held_out)} excluded")
    width = len(str(num - 1))
    rng = random.Random(f"tool-fraction-{seed}")  # apart from the questions' generator: the same questions at any F
    demos = []
    for i, r in enumerate(records):
        record = {**r, "id": f"demo-{i:0{width}d}"}
        if style == "chat":
            record["prompt"] = chat_prompt(r["prompt"])
        calls = tool_fraction >= 1.0 or rng.random() < tool_fraction
        if style == "chat" and calls:
            demos.append(demonstration(record, text_call=True))
        elif choice:
            right = ToolChoiceCalculatorEnv(record).right_tool()
            demos.append(demonstration(record, tool=right if calls else next(t for t in BOUND_TOOLS if t != right)))
        else:
            demos.append(demonstration(record, echo, bound) if calls else guessed_demonstration(record, bound))
    return demos


def guess(question: str, answer: str) -> str:
    """A wrong answer a model can give without computing: the digits of `question` run together ("59*63" ->
    "5963"), one more when that happens to be `answer`."""
    digits = "".join(c for c in question if c.isdigit()) or "0"
    return str(int(digits) + 1) if digits == answer else digits


def guessed_demonstration(record: dict, bound: bool = False) -> dict:
    """An episode of `record` that answers at once, without the tool, with a wrong `guess` (reward 0): the
    demonstrated alternative to calling. The guess is copied from the question rather than drawn at random:
    every demonstration then trains copying, and the only choice left open is whether to call (with random
    digits, a 2-layer model never learned to copy the tool's result in 600 SFT steps). It is bare, without the
    echo's "59*63=", so that "=" is followed by the result in every demonstration. `bound`: of
    QuestionCalculatorEnv, whose calling episodes need no copy of the question: the guess is then "0" ("1" if that is
    right), so that the calling episodes alone train copying (the tool's reply)."""
    env = (QuestionCalculatorEnv if bound else CalculatorEnv)(record)
    wrong = ("1" if env.answer == "0" else "0") if bound else guess(env.question, env.answer)
    messages = [*env.reset(), {"role": "assistant", "content": wrong}]
    return {"id": record["id"], "messages": messages, "tools": env.tools}


def demonstration(
    record: dict, echo: bool = False, bound: bool = False, tool: str | None = None, text_call: bool = False
) -> dict:
    """A solved episode of `record` for `rlx sft`: the opening messages, a calculator call with the question's
    expression, the tool's reply, and the answer (the reply: the value, or with `echo` the reply of
    EchoCalculatorEnv, "59*63=3717"); the tool listed as the environment offers it. `bound`: of
    QuestionCalculatorEnv, the call without arguments ("arguments": {}). `tool` (a BOUND_TOOLS name): of
    ToolChoiceCalculatorEnv, a call of that tool without arguments, answered with its reply (wrong for the wrong
    tool). `text_call`: the call written as the assistant's text, `<tool_call>\n{json}\n</tool_call>` as `SYSTEM`
    shows it, rather than as `tool_calls` (which a template that does not write tool calls renders as nothing)."""
    if tool:
        env = ToolChoiceCalculatorEnv(record)
    else:
        env = (QuestionCalculatorEnv if bound else EchoCalculatorEnv if echo else CalculatorEnv)(record)
    arguments = {} if bound or tool else {"expression": env.question}
    call = {
        "id": "call_0_0",  # the id a rollout gives a first turn's first call
        "type": "function",
        "function": {"name": tool or "calculator", "arguments": json.dumps(arguments)},
    }
    result = env.call(call)
    if text_call:
        written = json.dumps({"name": call["function"]["name"], "arguments": arguments})
        asked = {"role": "assistant", "content": f"<tool_call>\n{written}\n</tool_call>"}
    else:
        asked = {"role": "assistant", "content": "", "tool_calls": [call]}
    messages = [
        *env.reset(),
        asked,
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        {"role": "assistant", "content": result},
    ]
    return {"id": record["id"], "messages": messages, "tools": env.tools}


def main() -> None:
    parser = argparse.ArgumentParser(description="Write calculator-task prompts as prompts.jsonl.")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout)")
    parser.add_argument("--num", type=int, default=1000, help="number of questions (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--digits", type=int, default=3, help="digits per operand (default 3)")
    parser.add_argument("--ops", default="*", help="operators to draw from, e.g. '*+' (default '*')")
    parser.add_argument("--style", default="text", choices=("text", "chat"), help="chat: a system message on how to "
                        "call the tool, then the question as a user message; with --demos, episodes of such prompts "
                        "with the call written as text (default text)")  # fmt: skip
    parser.add_argument("--demos", action="store_true", help="write solved episodes for `rlx sft` instead of prompts: "
                        "messages (question, calculator call, its result, the answer) and tools")  # fmt: skip
    parser.add_argument("--exclude", help="with --demos: a prompts.jsonl whose questions the episodes leave out")
    parser.add_argument("--echo", action="store_true", help="with --demos: episodes of EchoCalculatorEnv (the tool "
                        "replies '12*34=408', the answer repeats it)")  # fmt: skip
    parser.add_argument("--bound", action="store_true", help="with --demos: episodes of QuestionCalculatorEnv (the "
                        "calls carry no arguments, the tool computes the question; implies --echo)")  # fmt: skip
    parser.add_argument("--choice", action="store_true", help="with --demos: episodes of ToolChoiceCalculatorEnv "
                        "(each calls `multiply` or `add`, bound to the question, and answers with its reply; "
                        "--tool-fraction is the share calling the right one)")  # fmt: skip
    parser.add_argument("--tool-fraction", type=float, default=1.0, help="with --demos: the share of episodes that "
                        "call the tool; the others answer at once with a wrong guess, the question's digits run "
                        "together (default 1)")  # fmt: skip
    args = parser.parse_args()
    if args.demos:
        exclude = (
            [question_of(json.loads(line)["prompt"]) for line in Path(args.exclude).read_text().splitlines()]
            if args.exclude
            else ()
        )
        demos = generate_demonstrations(
            args.num, args.seed, args.digits, args.ops, exclude, args.echo, args.tool_fraction, args.bound, args.choice,
            args.style,
        )  # fmt: skip
        write_jsonl(args.out, demos)
        return
    records = generate_calculator(args.num, args.seed, args.digits, args.ops)
    if args.style == "chat":
        for r in records:
            r["prompt"] = chat_prompt(r["prompt"])
    write_jsonl(args.out, records)


if __name__ == "__main__":
    main()
