"""``dasspec serve`` on a Nanbeige4.2 folder (a tiny random checkpoint in upstream's layout, ChatML template with the
thinking switch): the real server on 127.0.0.1 talked to with the real ``openai`` client.  Chat answers equal
``dasspec.generate(..., "ar")`` of the template rendered here, with the thinking block opened by default and
closed by ``chat_template_kwargs: {"enable_thinking": false}`` (vLLM / SGLang's field); bad kwargs are refused by
name."""

from __future__ import annotations

import openai
import pytest

import dasspec
from reference_impl import write_nanbeige_checkpoint, write_tokenizer
from test_serve import start_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_nanbeige_checkpoint(tmp_path_factory.mktemp("nanbeige-serve") / "tiny-nanbeige", vocab_size=320,
                                     seed=5, tokenizer=write_tokenizer("nanbeige"))


@pytest.fixture(scope="module")
def model(folder):
    return dasspec.load_model(folder, device="cpu")


@pytest.fixture(scope="module")
def client(folder, tmp_path_factory):
    srv = start_server(folder, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", "nb")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.stop()


def reference(model, **template_kwargs) -> tuple[list[int], str]:
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, **template_kwargs), add_special_tokens=False)
    return ids, dasspec.generate(model, ids, "ar", max_new_tokens=10).text


def test_chat_opens_a_thinking_block_unless_asked_not_to(client, model):
    ids, text = reference(model)
    assert model.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n")
    out = client.chat.completions.create(model="nb", messages=MESSAGES, max_tokens=10)
    assert out.choices[0].message.content == text and out.usage.prompt_tokens == len(ids)

    plain_ids, plain = reference(model, enable_thinking=False)
    assert len(plain_ids) > len(ids)
    out = client.chat.completions.create(model="nb", messages=MESSAGES, max_tokens=10,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == plain and out.usage.prompt_tokens == len(plain_ids)


@pytest.mark.parametrize("kwargs,words", [
    ({"messages": "x"}, "'messages' is not a template variable"),
    ({"not a name": 1}, "is not a template variable"),
    ({"enable_thinking": [1, 2]}, "chat_template_kwargs"),
    ({f"k{i}": 1 for i in range(17)}, "chat_template_kwargs"),
])
def test_bad_template_kwargs_are_refused_by_name(client, kwargs, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="nb", messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert words in str(err.value) and "chat_template_kwargs" in str(err.value)
