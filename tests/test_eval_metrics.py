"""LongBench metrics of eval/longbench/metrics.py on hand-checked cases (no model, no data needed)."""

import pytest

from eval.longbench import metrics as M


def test_normalize_answer():
    assert M.normalize_answer("The  Cat, sat!") == "cat sat"
    assert M.normalize_answer("An apple a day") == "apple day"
    assert M.normalize_answer("theater") == "theater"  # articles only as whole words


def test_qa_f1():
    # pred tokens [cat, sat], reference [cat, sat, down]: P = 1, R = 2/3, F1 = 0.8
    assert M.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert M.qa_f1_score("dog", "cat") == 0
    assert M.qa_f1_score("Yes.", "yes") == pytest.approx(1.0)
    # repeated tokens count with multiplicity: pred [a1, a1, b], ref [a1, b] -> common 2, P 2/3, R 1, F1 0.8
    assert M.qa_f1_score("x x y", "x y") == pytest.approx(0.8)


def test_count_and_retrieval():
    assert M.count_score("There are 5 and 7 paragraphs", "5") == pytest.approx(0.5)
    assert M.count_score("no numbers here", "5") == 0.0
    assert M.count_score("15", "5") == 0.0  # whole numbers, not digits
    assert M.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 4", "Paragraph 3") == pytest.approx(0.5)
    assert M.retrieval_score("I do not know", "Paragraph 3") == 0.0


def test_classification_official_semantics():
    classes = ["Individual", "Other location", "Location", "Other", "Other entity"]
    # "Other" and "Other entity" both match; "Other" is a sub-string of the answer -> removed -> 1/1
    assert M.classification_score("Other entity", "Other entity", all_classes=classes) == 1.0
    # two distinct matches, the right one among them -> 1/2 ("Location" is case-sensitive: no match)
    assert M.classification_score(
        "Individual or Other location", "Individual", all_classes=["Individual", "Other location", "Location"]
    ) == pytest.approx(0.5)
    # with "Other" among the classes it matches too (sub-string of "Other location", not of the answer) -> 1/3
    assert M.classification_score("Individual or Other location", "Individual", all_classes=classes) == pytest.approx(
        1 / 3
    )
    assert M.classification_score("Location", "Individual", all_classes=classes) == 0.0


def test_code_sim():
    # the first line without ` # // is used
    assert M.code_sim_score("```python\n# comment\nx = 1\n", "x = 1") == 1.0
    # SequenceMatcher ratio of 'abcd' / 'abce' = 2*3/8 = 0.75
    assert M.fuzz_ratio("abcd", "abce") == 75
    assert M.code_sim_score("abcd", "abce") == pytest.approx(0.75)
    # fuzzywuzzy's decorators: equal strings (even empty) 100, one empty 0
    assert M.fuzz_ratio("", "") == 100
    assert M.fuzz_ratio("a", "") == 0
    assert M.code_sim_score("// only a comment", "x = 1") == 0.0


def test_rouge_l():
    # LCS('the cat sat on the mat', 'the cat sat') = 3: P = 3/3, R = 3/6, F = 2/3
    assert M.rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # LCS('a b x d', 'a b c d') = 3 of 4 tokens each: P = R = F = 3/4 (lower-cased, punctuation dropped)
    assert M.rouge_score("A b, c d.", "a b x d") == pytest.approx(3 / 4)
    assert M.rouge_score("", "the cat") == 0.0
    assert M.example_score("samsum", "the cat sat", ["a dog", "the cat sat on the mat"]) == pytest.approx(2 / 3)


def test_example_score_first_line_and_max_over_answers():
    classes = ["Individual", "Other"]
    # trec: first line only ("Other" on line 2 is ignored)
    assert M.example_score("trec", "Individual\nOther", ["Individual"], classes) == 1.0
    # leading newlines are stripped before taking the first line
    assert M.example_score("triviaqa", "\n\n55\nfifty", ["55"]) == 1.0
    # max over the reference answers
    assert M.example_score("musique", "University of Toronto", ["UT", "University of Toronto"]) == 1.0
    assert M.example_score("gov_report", "the cat sat", ["x y", "the cat sat on the mat"]) == pytest.approx(2 / 3)
    # not first-line for qasper: the whole answer is scored
    assert M.example_score("qasper", "no\nyes", ["yes"]) == pytest.approx(2 / 3)


def test_scorer_rounding_and_errors():
    assert M.scorer("passage_count", ["5", "3"], [["5"], ["5"]]) == 50.0
    assert M.scorer("qasper", ["the cat sat"], [["a cat sat down"]]) == 80.0
    with pytest.raises(ValueError, match="jieba"):
        M.metric_for("dureader")
    with pytest.raises(ValueError, match="unknown"):
        M.metric_for("nope")
    with pytest.raises(ValueError):
        M.scorer("qasper", ["a"], [])
