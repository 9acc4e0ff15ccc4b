"""Calculator demonstrations of which only a share calls the tool (`--tool-fraction`): the others guess wrong."""

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


def test_the_tool_fraction_option_of_the_generator(tmp_path, monkeypatch):
    out = tmp_path / "demos.jsonl"
    argv = ["calculator", "--demos", "--echo", "--digits", "2", "--num", "30", "--tool-fraction", "0.5", "--out"]
    monkeypatch.setattr("sys.argv", [*argv, str(out)])
    calculator.main()
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == calculator.generate_demonstrations(30, seed=0, digits=2, echo=True, tool_fraction=0.5)
    assert 0 < sum(len(d["messages"]) == 4 for d in written) < 30
