"""GSM8K (Cobbe et al. 2021): eight-shot chain of thought, cap 512 (paper Table 4).

Demonstrations: the eight fixed chain-of-thought exemplars of Wei et al. (2022, Table 20) - the trees, cars,
chocolates, lollipops, toys, computers, golf balls and bagels problems - written in the GSM8K harness format
``Question: ...\\nAnswer: <reasoning> The answer is <n>.``, separated by blank lines.  The query ends with
``Answer:`` and the model continues with its reasoning.  Generation stops at the next ``Question:`` (the model
starting a new exemplar), at EOS, or at the cap.

Pool: the test split (1319 rows, file order); ids ``gsm8k/test/<row>``.
"""

from __future__ import annotations

from pathlib import Path

from .base import Example, Task, from_hub, data_file, read_jsonl

# Wei et al. (2022), "Chain-of-thought prompting elicits reasoning in large language models", Table 20.
EXEMPLARS: tuple[tuple[str, str, str], ...] = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6.", "6"),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5.", "5"),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39.", "39"),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8.",
     "8"),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9.", "9"),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29.", "29"),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls.", "33"),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8.", "8"),
)

STOP = ("Question:",)
CAP = 512


def demonstration(question: str, reasoning: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {reasoning} The answer is {answer}.\n\n"


def prompt(question: str, shots: int = len(EXEMPLARS)) -> str:
    return "".join(demonstration(*ex) for ex in EXEMPLARS[:shots]) + f"Question: {question}\nAnswer:"


def load(root: Path | None) -> list[dict]:
    path = data_file(root, "gsm8k/test.jsonl")
    rows = read_jsonl(path) if path else from_hub("GSM8K", "gsm8k/test.jsonl", "openai/gsm8k", "main",
                                                   split="test")
    return [{"row": i, **r} for i, r in enumerate(rows)]


def build(row: dict, shots: int) -> Example:
    answer = row["answer"].rsplit("####", 1)[-1].strip()
    return Example("gsm8k", f"gsm8k/test/{row['row']}", prompt(row["question"], shots), answer)


TASK = Task("gsm8k", CAP, STOP, load, build, shots=len(EXEMPLARS), max_shots=len(EXEMPLARS))
