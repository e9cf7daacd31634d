"""ROUGE as a local `evaluate` metric (works offline, unlike ``evaluate.load("rouge")`` which fetches its script from
the Hub). It wraps Google's ``rouge_score`` package the same way the Hub's ``rouge`` metric does.

Usage::

    import evaluate
    rouge = evaluate.load("eval/longbench/rouge_local")
    rouge.compute(predictions=["the cat sat"], references=["the cat sat on the mat"], use_aggregator=False)
    # {'rouge1': [...], 'rouge2': [...], 'rougeL': [...], 'rougeLsum': [...]}  (F-measures)
"""

import datasets
import evaluate
from rouge_score import rouge_scorer, scoring

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
    publisher = "Association for Computational Linguistics",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-1/2/L/Lsum F-measures computed with the `rouge_score` package (default tokenizer: lower-cased, runs of
[a-z0-9] only). rougeL is the sentence-level LCS over the whole text; rougeLsum splits on newlines.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predictions (str).
    references: list of references (str), one per prediction.
    rouge_types: list of types among 'rouge1', 'rouge2', 'rougeL', 'rougeLsum' (default: all four).
    use_aggregator: True: mean F-measure of each type; False: a list with one F-measure per pair.
    use_stemmer: apply the Porter stemmer (default False).
    tokenizer: optional object with a ``tokenize(text) -> list[str]`` method, or a callable, replacing the default.
Returns:
    dict rouge type -> float (aggregated) or list of floats.
"""


class _CallableTokenizer:
    def __init__(self, fn):
        self.fn = fn

    def tokenize(self, text):
        return self.fn(text)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RougeLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string", id="sequence"),
                    "references": datasets.Value("string", id="sequence"),
                }
            ),
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
            reference_urls=["https://en.wikipedia.org/wiki/ROUGE_(metric)"],
        )

    def _compute(
        self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False, tokenizer=None
    ):
        if rouge_types is None:
            rouge_types = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        if tokenizer is not None and not hasattr(tokenizer, "tokenize"):
            tokenizer = _CallableTokenizer(tokenizer)
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types, use_stemmer=use_stemmer, tokenizer=tokenizer)
        if use_aggregator:
            aggregator = scoring.BootstrapAggregator()
        else:
            per_pair = {t: [] for t in rouge_types}
        for ref, pred in zip(references, predictions):
            score = scorer.score(ref, pred)
            if use_aggregator:
                aggregator.add_scores(score)
            else:
                for t in rouge_types:
                    per_pair[t].append(score[t].fmeasure)
        if use_aggregator:
            result = aggregator.aggregate()
            return {t: float(result[t].mid.fmeasure) for t in rouge_types}
        return per_pair
