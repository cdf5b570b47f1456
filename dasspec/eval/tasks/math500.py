"""MATH-500 (Lightman et al. 2023): four fixed Minerva-style worked demonstrations, cap 1024 (paper Table 4).

Demonstrations: the four MATH problems of the Minerva prompt (Lewkowycz et al. 2022, Appendix D.2; also
lm-evaluation-harness ``minerva_math``): domain of sqrt(x-2)/sqrt(5-x), det(AB), Terrell's weights, and the
a/b linear system, each formatted as ``Problem:\\n<problem>\\n\\nSolution:\\n<solution>\\nFinal Answer: The final
answer is $<answer>$. I hope it is correct.``  The query ends with ``Solution:\\n``.  Generation stops at the next
``Problem:`` (the harness's stop string), at EOS, or at the cap.

Pool: all 500 test problems in file order; ids are MATH's ``unique_id`` (``test/<subject>/<n>.json``).
"""

from __future__ import annotations

from pathlib import Path

from .base import Example, Task, from_hub, data_file, read_jsonl

# (problem, solution, final answer) - the Minerva four-shot prompt, verbatim (its typos included).
DEMONSTRATIONS: tuple[tuple[str, str, str], ...] = (
    (r"Find the domain of the expression  $\frac{\sqrt{x-2}}{\sqrt{5-x}}$.}",
     r"The expressions inside each square root must be non-negative. Therefore, $x-2 \ge 0$, so $x\ge2$, and "
     r"$5 - x \ge 0$, so $x \le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. "
     r"Therefore, the domain of the expression is $\boxed{[2,5)}$.",
     "[2,5)"),
    (r"If $\det \mathbf{A} = 2$ and $\det \mathbf{B} = 12,$ then find $\det (\mathbf{A} \mathbf{B}).$",
     r"We have that $\det (\mathbf{A} \mathbf{B}) = (\det \mathbf{A})(\det \mathbf{B}) = (2)(12) = \boxed{24}.$",
     "24"),
    ("Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many "
     "times must Terrell lift them in order to lift the same total weight?",
     r"If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\cdot 12\cdot20=480$ pounds of "
     r"weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of "
     r"$2\cdot15\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:" "\n"
     r"\begin{align*}" "\n" r"30n&=480\\" "\n" r"\Rightarrow\qquad n&=480/30=\boxed{16}" "\n" r"\end{align*}",
     "16"),
    ("If the system of equations\n\n" r"\begin{align*}" "\n" r"6x-4y&=a,\\" "\n" r"6y-9x &=b." "\n"
     r"\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero," "\n"
     r"find $\frac{a}{b},$ assuming $b$ is nonzero.",
     r"If we multiply the first equation by $-\frac{3}{2}$, we obtain" "\n\n"
     r"$$6y-9x=-\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we have" "\n\n"
     r"$$-\frac{3}{2}a=b\Rightarrow\frac{a}{b}=\boxed{-\frac{2}{3}}.$$",
     r"-\frac{2}{3}"),
)

STOP = ("Problem:",)
CAP = 1024


def demonstration(problem: str, solution: str, answer: str) -> str:
    return (f"Problem:\n{problem}\n\nSolution:\n{solution}\n"
            f"Final Answer: The final answer is ${answer}$. I hope it is correct.\n\n")


def prompt(problem: str, shots: int = len(DEMONSTRATIONS)) -> str:
    return "".join(demonstration(*d) for d in DEMONSTRATIONS[:shots]) + f"Problem:\n{problem}\n\nSolution:\n"


def load(root: Path | None) -> list[dict]:
    path = data_file(root, "math500/test.jsonl")
    return read_jsonl(path) if path else from_hub("MATH-500", "math500/test.jsonl", "HuggingFaceH4/MATH-500",
                                                  split="test")


def build(row: dict, shots: int) -> Example:
    return Example("math500", row["unique_id"], prompt(row["problem"], shots), row["answer"])


TASK = Task("math500", CAP, STOP, load, build, shots=len(DEMONSTRATIONS), max_shots=len(DEMONSTRATIONS),
            aliases=("math-500", "math"))
