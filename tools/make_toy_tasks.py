"""Write the embedded toy task set: gyre/tasks/toy/tasks.jsonl (trained on) and eval.jsonl (held out).

Each task asks for one word in one file; the pairs (word, file) of eval.jsonl never appear in
tasks.jsonl, though each word and each file does, so the held-out set measures copying both from
the instruction rather than recalling a trained pair. A few words' evaluators crash at random
(`--fail-rate`), as flaky infrastructure does. Deterministic: re-running rewrites the same files.

    python tools/make_toy_tasks.py
"""

from pathlib import Path

from gyre.common import jsonio

WORDS = "apple river stone cloud tiger lemon piano robot".split()
FILES = ("answer.txt", "out.txt", "note.txt")
FLAKY = {"cloud", "robot"}
OUT = Path(__file__).resolve().parents[1] / "gyre" / "tasks" / "toy"


def make_task(word: str, file: str, task_id: str) -> dict:
    instruction = f'Write "{word}" to "{file}".'
    check = f"{{python}} {{pkg}}/tasks/toy/check.py {file} {word}" + (" --fail-rate 0.1" if word in FLAKY else "")
    return {
        "task_id": task_id,
        "instruction": instruction,
        "workspace": {"files": {"task.md": instruction + "\n"}},
        "setup": None,
        "evaluator": {"kind": "json_score", "command": check, "timeout_s": 30},
        "time_budget_s": 30,
        "reference": {"files": {file: word}},
    }


def main() -> None:
    train, held_out = [], []
    for j, file in enumerate(FILES):  # the answer.txt tasks first
        for i, word in enumerate(WORDS):
            stem = file.removesuffix(".txt")
            if j == (i + 1) % len(FILES):  # one pair per word held out, the files in turn
                held_out.append(make_task(word, file, f"eval-{word}-{stem}"))
            else:
                train.append(make_task(word, file, f"word-{word}" + ("" if stem == "answer" else f"-{stem}")))
    for name, tasks in (("tasks.jsonl", train), ("eval.jsonl", held_out)):
        (OUT / name).write_text("".join(jsonio.dumps(t) + "\n" for t in tasks))
        print(f"{name}: {len(tasks)} tasks")


if __name__ == "__main__":
    main()
