"""eval/chat: the one prompt rule. A tokenizer with a chat template gets the chat form, one without (a base model
such as Gemma 3 270M) the completion form, in the LongBench, needle and RULER prompts alike."""

from eval.chat import has_chat_template
from eval.longbench.prompts import build_prompt as longbench_prompt
from eval.needle import ruler
from eval.needle.cases import build_prompt as needle_prompt

from .conftest import make_tokenizer

TEMPLATE = "{% for m in messages %}<u> {{ m['content'] }} </u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def _tokenizers():
    base, chat = make_tokenizer(), make_tokenizer()
    chat.chat_template = TEMPLATE
    return base, chat


def test_the_rule_decides_every_prompt_builder():
    base, chat = _tokenizers()
    assert not has_chat_template(base) and has_chat_template(chat)
    ex = {"context": "w1 w2 w3", "input": "what is the code ?"}
    lb_base = longbench_prompt(base, "qasper", ex, "{context} Q: {input}", 4096)
    lb_chat = longbench_prompt(chat, "qasper", ex, "{context} Q: {input}", 4096)
    assert (lb_base.chat, lb_base.prompt, lb_base.tokenizer_kwargs) == (False, "w1 w2 w3 Q: what is the code ?", {})
    assert lb_chat.chat and lb_chat.prompt.startswith("<u> w1 w2 w3") and lb_chat.prompt.endswith("</u><a>")
    assert lb_chat.tokenizer_kwargs == {"add_special_tokens": False}
    n_base, kw_base = needle_prompt(base, "w1 w2")
    n_chat, kw_chat = needle_prompt(chat, "w1 w2")
    assert not n_base.startswith("<u>") and "w1 w2" in n_base and kw_base == {}
    assert n_chat.startswith("<u>") and kw_chat == {"add_special_tokens": False}
    r_base, q, kw = ruler.build_prompt(base, "w1 w2", ["happy-marble"], True)
    assert "<a>" not in r_base and r_base.endswith("mentioned in the provided text is") and kw == {}
    r_chat, _, _ = ruler.build_prompt(chat, "w1 w2", ["happy-marble"], True)
    assert "</u><a>The special magic number for happy-marble" in r_chat
