"""Calculator demonstrations: only a share calling the tool (`--tool-fraction`, the others guess wrong), calls without
arguments (`--bound`, QuestionCalculatorEnv), a choice between two tools bound to the question (`--choice`,
ToolChoiceCalculatorEnv)."""

from __future__ import annotations

import json

import pytest

from rlx.tasks import calculator


def test_a_tool_fraction_keeps_the_questions_and_makes_the_rest_wrong_guesses_from_the_question():
    full = calculator.generate_demonstrations(400, seed=1, digits=2, echo=True)
    mixed = calculator.generate_demonstrations(400, seed=1, digits=2, echo=True, tool_fraction=0.3)
    assert [d["messages"][0] for d in mixed] == [d["messages"][0] for d in full]  # the same questions, same ids
    assert [d["id"] for d in mixed] == [d["id"] for d in full]
    callers = [(m, f) for m, f in zip(mixed, full) if len(m["messages"]) == 4]
    assert 90 <= len(callers) <= 150  # ~120 of 400
    assert all(m == f for m, f in callers)  # a calling episode is the full-tool one
    for demo in mixed:
        if len(demo["messages"]) == 4:
            continue
        question, (answer,) = demo["messages"][0]["content"], demo["messages"][1:]
        record = {"prompt": question, "ground_truth": str(calculator.evaluate(question))}
        wrong = answer["content"]  # bare, without the echo's "12*34=" (see guessed_demonstration)
        assert answer["role"] == "assistant" and "tool_calls" not in answer
        assert wrong == question.replace("*", "") != record["ground_truth"]  # copied from the question
        env = calculator.EchoCalculatorEnv(record)
        assert env.step(answer) == ([], 0.0, True)  # the environment grades the guess wrong
        assert demo["tools"] == calculator.CalculatorEnv.tools
    none = calculator.generate_demonstrations(20, seed=1, digits=2, tool_fraction=0.0)
    assert all(len(d["messages"]) == 2 and d["messages"][1]["content"].isdigit() for d in none)  # plain: the number
    assert calculator.generate_demonstrations(20, seed=1, digits=2, tool_fraction=1.0) == (
        calculator.generate_demonstrations(20, seed=1, digits=2)
    )
    with pytest.raises(ValueError, match=r"tool_fraction must be in \[0, 1\], got 1.5"):
        calculator.generate_demonstrations(5, tool_fraction=1.5)


def test_a_guess_runs_the_question_digits_together_and_is_never_the_answer():
    assert calculator.guess("59*63", "3717") == "5963" and calculator.guess("-12+345", "333") == "12345"
    assert calculator.guess("3*5", "35") == "36"  # made-up answer equal to the digits: one more


def test_the_question_calculator_computes_the_question_when_called_without_an_expression():
    env = calculator.QuestionCalculatorEnv({"prompt": "59*63", "ground_truth": "3717"})
    assert env.tools[0]["function"]["parameters"]["required"] == []  # the expression is optional
    bare = {"id": "c0", "function": {"name": "calculator", "arguments": "{}"}}
    none = {"id": "c1", "function": {"name": "calculator"}}
    explicit = {"id": "c2", "function": {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}}
    replies, reward, done = env.step({"role": "assistant", "content": "", "tool_calls": [bare, none, explicit]})
    assert [r["content"] for r in replies] == ["59*63=3717", "59*63=3717", "2*3=6"] and (reward, done) == (0.0, False)
    assert [r["tool_call_id"] for r in replies] == ["c0", "c1", "c2"]
    for arguments, error in (('{"expression": "59*"}', "cannot read"), ("[1]", "error"), ("{", "error")):
        wrong = {"id": "c", "function": {"name": "calculator", "arguments": arguments}}
        assert env.call(wrong).startswith("error: ") and error in env.call(wrong)
    assert env.call({"id": "c", "function": {"name": "search", "arguments": "{}"}}) == "error: unknown tool 'search'"
    assert env.step({"role": "assistant", "content": "59*63=3717"})[1:] == (1.0, True)
    assert env.step({"role": "assistant", "content": "5963"})[1:] == (0.0, True)


def test_bound_demonstrations_call_without_arguments_and_list_the_optional_tool():
    mixed = calculator.generate_demonstrations(200, seed=1, digits=2, tool_fraction=0.3, bound=True)
    echo = calculator.generate_demonstrations(200, seed=1, digits=2, echo=True, tool_fraction=0.3)
    assert [len(d["messages"]) for d in mixed] == [len(d["messages"]) for d in echo]  # the same share, same episodes
    assert all(d["tools"] == calculator.QuestionCalculatorEnv.tools for d in mixed)
    callers = [d for d in mixed if len(d["messages"]) == 4]
    assert 40 <= len(callers) <= 80
    for demo in callers:
        question, call, reply, answer = demo["messages"]
        (tool_call,) = call["tool_calls"]
        assert tool_call["function"]["arguments"] == "{}"
        record = {"prompt": question["content"], "ground_truth": str(calculator.evaluate(question["content"]))}
        env = calculator.QuestionCalculatorEnv(record)
        assert env.step(call)[0] == [reply] and reply["content"] == f"{question['content']}={record['ground_truth']}"
        assert answer["content"] == reply["content"] and env.step(answer)[1:] == (1.0, True)
    for demo in mixed:
        if len(demo["messages"]) == 2:  # a guess that needs no copying, graded wrong
            question, answer = demo["messages"]
            assert answer == {"role": "assistant", "content": "0"}
            env = calculator.QuestionCalculatorEnv({"prompt": question["content"], "ground_truth": "1"})
            assert env.step(answer)[1:] == (0.0, True)
    zero = calculator.guessed_demonstration({"id": "d", "prompt": "0*5", "ground_truth": "0"}, bound=True)
    assert zero["messages"][-1]["content"] == "1"  # "0" would be right


@pytest.mark.parametrize(
    "flags, kwargs",
    [(["--echo"], {"echo": True}), (["--bound"], {"bound": True}), (["--choice"], {"choice": True})],
    ids=["echo", "bound", "choice"],
)
def test_the_generator_options(tmp_path, monkeypatch, flags, kwargs):
    out = tmp_path / "demos.jsonl"
    argv = ["calculator", "--demos", *flags, "--digits", "2", "--num", "30", "--tool-fraction", "0.5", "--out"]
    monkeypatch.setattr("sys.argv", [*argv, str(out)])
    calculator.main()
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == calculator.generate_demonstrations(30, seed=0, digits=2, tool_fraction=0.5, **kwargs)
    assert written != calculator.generate_demonstrations(30, seed=0, digits=2, **kwargs)  # --tool-fraction applied


def test_the_tool_choice_calculator_applies_the_called_tools_operator_to_the_question():
    env = calculator.ToolChoiceCalculatorEnv({"prompt": "59*63", "ground_truth": "3717"})
    assert [t["function"]["name"] for t in env.tools] == ["multiply", "add"]
    assert all(t["function"]["parameters"] == {"type": "object", "properties": {}, "required": []} for t in env.tools)
    calls = [
        {"id": "c0", "function": {"name": "multiply", "arguments": "{}"}},
        {"id": "c1", "function": {"name": "add"}},
        {"id": "c2", "function": {"name": "add", "arguments": '{"expression": "2*3"}'}},  # arguments are ignored
        {"id": "c3", "function": {"name": "calculator", "arguments": "{}"}},
    ]
    replies, reward, done = env.step({"role": "assistant", "content": "", "tool_calls": calls})
    assert [r["content"] for r in replies] == [
        "59*63=3717",
        "59+63=122",
        "59+63=122",
        "error: unknown tool 'calculator'",
    ]
    assert [r["tool_call_id"] for r in replies] == ["c0", "c1", "c2", "c3"] and (reward, done) == (0.0, False)
    assert env.right_tool() == "multiply" and env.step({"role": "assistant", "content": "59*63=3717"})[1:] == (
        1.0,
        True,
    )
    assert env.step({"role": "assistant", "content": "59+63=122"})[1:] == (0.0, True)
    assert calculator.ToolChoiceCalculatorEnv({"prompt": "5 + 7", "ground_truth": "12"}).right_tool() == "add"
    odd = calculator.ToolChoiceCalculatorEnv({"prompt": "what is 5 times 7", "ground_truth": "35"})
    assert odd.right_tool() is None and odd.call(calls[0]).startswith("error: the question")


@pytest.mark.parametrize("ops", ["*", "*+"])
def test_choice_demonstrations_call_either_tool_and_answer_with_its_reply(ops):
    demos = calculator.generate_demonstrations(400, seed=1, digits=2, ops=ops, tool_fraction=0.5, choice=True)
    assert all(len(d["messages"]) == 4 and d["tools"] == calculator.ToolChoiceCalculatorEnv.tools for d in demos)
    num_right = 0
    for demo in demos:
        question, call, reply, answer = demo["messages"]
        (tool_call,) = call["tool_calls"]
        record = {"prompt": question["content"], "ground_truth": str(calculator.evaluate(question["content"]))}
        env = calculator.ToolChoiceCalculatorEnv(record)
        assert tool_call["function"]["arguments"] == "{}" and tool_call["function"]["name"] in calculator.BOUND_TOOLS
        assert env.step(call)[0] == [reply] and answer == {"role": "assistant", "content": reply["content"]}
        is_right = tool_call["function"]["name"] == env.right_tool()
        assert env.step(answer)[1:] == (float(is_right), True)  # the copied reply is right iff the tool was
        num_right += is_right
    assert 170 <= num_right <= 230  # ~200 of 400
    same = calculator.generate_demonstrations(400, seed=1, digits=2, ops=ops, tool_fraction=0.5, bound=True)
    assert [d["messages"][0] for d in demos] == [d["messages"][0] for d in same]  # the questions of the other options
    for demo in calculator.generate_demonstrations(50, seed=1, digits=2, ops=ops, choice=True):  # tool_fraction 1
        env = calculator.ToolChoiceCalculatorEnv({"prompt": demo["messages"][0]["content"], "ground_truth": "0"})
        assert demo["messages"][1]["tool_calls"][0]["function"]["name"] == env.right_tool()
    with pytest.raises(ValueError, match=r"choice: ops must be made of \*\+, got '\*-'"):
        calculator.generate_demonstrations(5, ops="*-", choice=True)


def test_chat_demonstrations_open_with_the_system_message_and_write_the_call_as_text():
    """--style chat: the episode of a chat prompt, its call written as the assistant's text exactly as SYSTEM shows
    it (a template that drops tool_calls, SmolLM2's, still trains it), which the environment then answers."""
    from rlx.chat.tool_calls import parse_qwen

    demos = calculator.generate_demonstrations(4, seed=1, digits=4, style="chat")
    for demo in demos:
        system, user, call, tool, answer = demo["messages"]
        assert system == {"role": "system", "content": calculator.SYSTEM} and user["role"] == "user"
        assert "tool_calls" not in call and call["content"].startswith("<tool_call>\n")
        template = calculator.SYSTEM.split("reply with only ")[1].split(" (your")[0]
        assert call["content"] == template.replace("12*34", user["content"])
        parsed = parse_qwen(call["content"], 0).message["tool_calls"]
        env = calculator.CalculatorEnv({"prompt": [system, user], "ground_truth": answer["content"]})
        assert env.call(parsed[0]) == tool["content"] == answer["content"]
    with pytest.raises(ValueError, match="style 'chat' goes with the plain calculator"):
        calculator.generate_demonstrations(4, style="chat", choice=True)
