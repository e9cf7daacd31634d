"""LongBench v1 metrics, as in the official ``LongBench/metrics.py`` and ``eval.py`` (English tasks).

Differences from the official code, all documented in ``eval/README.md``:

* ROUGE-L is Google's ``rouge_score`` (rougeL F-measure, its default tokenizer, no stemming, as the Hub's ``rouge``
  metric of ``evaluate`` computes it), whereas LongBench uses the ``rouge`` PyPI package (summary-level
  LCS over '.'-split sentences, whitespace tokens). Scores are comparable between methods, not with published
  numbers.
* ``code_sim_score`` uses ``difflib.SequenceMatcher`` as fuzzywuzzy's ``fuzz.ratio`` does when python-Levenshtein
  is not installed (rapidfuzz is not installed here); fuzzywuzzy with python-Levenshtein may differ slightly.
* Chinese tasks (their metrics need jieba) are not supported.
"""

from __future__ import annotations

import difflib
import functools
import re
import string
from collections import Counter


@functools.cache
def rouge_l():
    """Google's ROUGE-L scorer (``rouge_score.rouge_scorer.RougeScorer``), made once."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:
        raise ImportError("LongBench's ROUGE-L needs rouge-score: pip install -e '.[eval]'") from e
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (LongBench / SQuAD)."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    numbers = re.findall(r"\d+", prediction)
    right_num = sum(1 for number in numbers if str(number) == str(ground_truth))
    return 0.0 if len(numbers) == 0 else float(right_num / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    matches = re.findall(r"Paragraph (\d+)", ground_truth)
    ground_truth_id = matches[0]
    numbers = re.findall(r"\d+", prediction)
    right_num = sum(1 for number in numbers if str(number) == str(ground_truth_id))
    return 0.0 if len(numbers) == 0 else float(right_num / len(numbers))


def fuzz_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (pure-Python path): ``int(round(100 * SequenceMatcher(None, s1, s2).ratio()))``."""
    # fuzzywuzzy's decorators, in their order: check_for_none, check_for_equivalence, check_empty_string
    if s1 is None or s2 is None:
        return 0
    if s1 == s2:
        return 100
    if len(s1) == 0 or len(s2) == 0:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    all_lines = prediction.lstrip("\n").split("\n")
    prediction = ""
    for line in all_lines:
        if ("`" not in line) and ("#" not in line) and ("//" not in line):
            prediction = line
            break
    return fuzz_ratio(prediction, ground_truth) / 100


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    em_match_list = []
    all_classes = kwargs["all_classes"]
    for class_name in all_classes:
        if class_name in prediction:
            em_match_list.append(class_name)
    for match_term in em_match_list:  # noqa: B007  (official code: removes while iterating, kept as is)
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F-measure of one pair."""
    return float(rouge_l().score(ground_truth, prediction)["rougeL"].fmeasure)


def f1_score(prediction, ground_truth, **kwargs) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction)
    recall = 1.0 * num_same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    return f1_score(prediction_tokens, ground_truth_tokens)


DATASET2METRIC = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
ENGLISH_TASKS = list(DATASET2METRIC)
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
CHINESE_TASKS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")


def metric_for(task: str):
    if task in CHINESE_TASKS:
        raise ValueError(f"task {task!r} is Chinese: its metrics need jieba and are not supported by this harness")
    if task not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench task {task!r}; supported: {ENGLISH_TASKS}")
    return DATASET2METRIC[task]


def example_score(task: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """Score of one prediction in [0, 1]: first line only for trec/triviaqa/samsum/lsht, max over the answers."""
    metric = metric_for(task)
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return float(score)


def scorer(task: str, predictions: list[str], answers: list[list[str]], all_classes=None) -> float:
    """LongBench's ``eval.py`` scorer: mean example score x 100, rounded to 2 decimals."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise ValueError("no predictions to score")
    total = sum(example_score(task, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)
