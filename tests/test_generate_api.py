"""``dasspec.generate`` on checkpoints with a tokenizer: prompt forms, stop tokens taken from the tokenizer files
(never Raven's stale Huginn ids), streaming, and bad input failing with a message that names the problem."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dasspec
from dasspec.engine.api.generate import default_stop_ids
from reference_impl import write_checkpoint, write_tokenizer

TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def raven(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("gen") / "raven", "raven-llama", vocab_size=320,
                              tokenizer=write_tokenizer("raven-llama"), mean_recurrence=3)
    return dasspec.load_model(folder, device="cpu")


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    """A Huginn checkpoint with a 64-position context (its stored RoPE table cut to match, as the loader checks)."""
    from safetensors.torch import load_file, save_file

    folder = write_checkpoint(tmp_path_factory.mktemp("gen") / "huginn", "huginn", vocab_size=320,
                              tokenizer=write_tokenizer("huginn"), mean_recurrence=3,
                              config_edits={"block_size": 64})
    tensors = load_file(folder / "model.safetensors")
    tensors["freqs_cis"] = tensors["freqs_cis"][:, :64].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return dasspec.load_model(folder, device="cpu")


def test_text_prompt(raven):
    tok = raven.tokenizer
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id == tok.token_to_id("<|begin_of_text|>")        # the tokenizer's BOS, not 65504
    out = dasspec.generate(raven, TEXT, max_new_tokens=6, eos=False)
    assert len(out.tokens) == 6 and out.text == tok.decode(out.tokens)
    assert out.stats.prompt_tokens == len(ids) and out.stats.new_tokens == 6
    assert out.stats.prefill_passes == raven.config.mean_recurrence == 3        # default depth R
    assert out.stop_reason == "max_new_tokens"


def test_prompt_forms_agree(raven):
    ids = raven.tokenizer.encode(TEXT)
    runs = [dasspec.generate(raven, x, max_new_tokens=5, num_steps=2, eos=False).tokens
            for x in (TEXT, ids, torch.tensor(ids), torch.tensor([ids]))]
    assert all(r == runs[0] for r in runs)


def test_stop_ids_come_from_the_tokenizer(raven, huginn):
    # Raven's config.json says eos 65505 (Huginn's); the tokenizer says <|end_of_text|>
    assert raven.config.eos_token_id == []
    assert default_stop_ids(raven) == [raven.tokenizer.token_to_id("<|end_of_text|>")]
    tok = huginn.tokenizer
    assert default_stop_ids(huginn) == [tok.token_to_id("<|end_text|>"), tok.token_to_id("<|end_turn|>")]


def test_tokenizer_eos_stops_generation(raven, tmp_path):
    free = dasspec.generate(raven, TEXT, max_new_tokens=8, num_steps=2, eos=False).tokens
    i = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    eos_text = raven.tokenizer.backend.id_to_token(free[i])
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("raven-llama"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_text, "bos_token": "<|begin_of_text|>"}))
    model = dasspec.load_model(folder, device="cpu")
    out = dasspec.generate(model, TEXT, max_new_tokens=8, num_steps=2)
    assert out.tokens == free[: i + 1] and out.stop_reason == "eos"
    out = dasspec.generate(model, TEXT, max_new_tokens=8, num_steps=2, eos=False)
    assert out.tokens == free


def _mark_special(folder, i: int) -> None:
    """Make id i one of the tokenizer's special added tokens (as a chat model's end-of-turn token is)."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    content = next(t for t, j in spec["model"]["vocab"].items() if j == i)
    spec["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(spec))


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("special", [True, False])
def test_eos_ids_the_configs_name_stop_generation_where_the_tokenizer_marks_them(raven, tmp_path, where, special):
    """A chat model may name its end-of-turn id only in config.json's or generation_config.json's eos_token_id
    (IQuest-Loop lists three): a reply stops there as with Hugging Face's generate, beside the tokenizer's own EOS.
    An id the tokenizer holds as a word (a Raven config's stale Huginn ids) stops nothing."""
    free = dasspec.generate(raven, TEXT, max_new_tokens=8, num_steps=2, eos=False).tokens
    i = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] and not raven.tokenizer.is_special(t))
    own = raven.tokenizer.token_to_id("<|end_of_text|>")
    edits = {"eos_token_id": [own, free[i]]} if where == "config.json" else {}
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("raven-llama"), config_edits=edits)
    if where == "generation_config.json":
        (folder / where).write_text(json.dumps({"eos_token_id": [free[i], 10 ** 6]}))   # one outside the vocab
    if special:
        _mark_special(folder, free[i])
    model = dasspec.load_model(folder, device="cpu")
    assert model.tokenizer.is_special(free[i]) == special
    assert default_stop_ids(model) == ([own, free[i]] if special else [own])
    want = free[: i + 1] if special else free
    for method in ("ar", "pld"):
        out = dasspec.generate(model, TEXT, method, max_new_tokens=8, num_steps=2)
        assert out.tokens == want and out.stop_reason == ("eos" if special else "max_new_tokens")
    [got] = dasspec.generate_batch(model, [TEXT], max_new_tokens=8, num_steps=2)
    assert got.tokens == want


def test_without_a_tokenizer_generation_configs_eos_stops_nothing(tmp_path):
    """Without a tokenizer nothing tells a stale id from a real one: only config.json's ids as the family keeps them
    stop (none for Raven, whose files carry Huginn's 65505 - an ordinary word of its vocabulary - in both)."""
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=70000, mean_recurrence=2,
                              config_edits={"eos_token_id": 65505})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [65505, 7]}))
    model = dasspec.load_model(folder, device="cpu")
    assert model.tokenizer is None and default_stop_ids(model) == []


@pytest.mark.parametrize("value", ["2", [1, "x"], [2, None], -1, 1.5, True])
def test_a_bad_eos_id_in_either_config_is_named(tmp_path, value):
    """One check for an eos_token_id value wherever it stands (``fields.eos_list``): config.json's (a null inside a
    list once reached ``int(None)``) and generation_config.json's."""
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("raven-llama"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(ValueError, match="eos_token_id of generation_config.json"):
        dasspec.load_model(folder, device="cpu")
    folder = write_checkpoint(tmp_path / "c", "huginn", vocab_size=320, config_edits={"eos_token_id": value})
    with pytest.raises(ValueError, match="eos_token_id"):
        dasspec.load_model(folder, device="cpu")


def test_stop_token_and_string(raven):
    free = dasspec.generate(raven, TEXT, max_new_tokens=8, num_steps=2, eos=False).tokens
    out = dasspec.generate(raven, TEXT, max_new_tokens=8, num_steps=2, eos=False, stop=[free[3]])
    assert out.tokens == free[: free.index(free[3]) + 1] and out.stop_reason == "eos"
    full_text = raven.tokenizer.decode(free)
    piece = next(raven.tokenizer.decode([t]) for t in free[2:] if raven.tokenizer.decode([t]).strip())
    out = dasspec.generate(raven, TEXT, max_new_tokens=8, num_steps=2, eos=False, stop=piece)
    assert out.stop_reason == "stop_string" and piece not in out.text and full_text.startswith(out.text)


def test_streamer_receives_the_prompt_then_every_token_once(raven):
    """Hugging Face's streamer protocol: put(prompt ids [1, P]) first, then every committed chunk, then end()."""
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], 0

        def put(self, chunk):
            assert chunk.dim() == 2 and chunk.shape[0] == 1
            self.chunks.append(chunk.reshape(-1).tolist())

        def end(self):
            self.ended += 1

    for method in ("ar", "pld"):
        s = Collect()
        out = dasspec.generate(raven, TEXT, method, max_new_tokens=7, num_steps=2, streamer=s, eos=False)
        assert s.chunks[0] == raven.tokenizer.encode(TEXT)
        assert sum(s.chunks[1:], []) == out.tokens and s.ended == 1


def test_deterministic_and_seeded(huginn):
    """``state_seed`` seeds the per-position initial states: the same seed gives the same tokens, and the seed
    reaches the states (among a few seeds the outputs differ; with a zero initial state it cannot matter).  The
    sampling ``seed`` does not touch them: greedy decoding is the same for every ``seed``."""
    runs = {s: dasspec.generate(huginn, TEXT, max_new_tokens=6, num_steps=2, state_seed=s, eos=False).tokens
            for s in range(6)}
    assert dasspec.generate(huginn, TEXT, max_new_tokens=6, num_steps=2, state_seed=1, eos=False).tokens == runs[1]
    assert len({tuple(t) for t in runs.values()}) > 1, "the state seed never changed the output"
    zero = {tuple(dasspec.generate(huginn, TEXT, max_new_tokens=6, num_steps=2, state_seed=s, eos=False,
                                   init_scale=0.0).tokens) for s in range(3)}
    assert len(zero) == 1
    greedy = {tuple(dasspec.generate(huginn, TEXT, max_new_tokens=6, num_steps=2, seed=s, eos=False).tokens)
              for s in range(3)}
    assert greedy == {tuple(runs[0])}


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(input_ids=[]), ValueError, "empty prompt"),
    (dict(num_steps=0), ValueError, "num_steps must be >= 1, got 0"),
    (dict(num_steps=-2), ValueError, "num_steps must be >= 1, got -2"),
    (dict(num_steps=2.5), ValueError, "num_steps must be a whole number, got 2.5"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1, got 0"),
    (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be a whole number, got 2.5"),
    (dict(init_scale=float("nan")), ValueError, "init_scale must be a finite number >= 0"),
    (dict(init_scale=-1.0), ValueError, "init_scale must be a finite number >= 0"),
    (dict(input_ids=[3, 320, 4]), ValueError, r"token id 320 is outside the vocabulary \[0, 320\)"),
    (dict(input_ids=torch.zeros(2, 4, dtype=torch.long)), ValueError, "a batch of 2"),
    (dict(method="beam"), ValueError, "unknown method 'beam'"),
    (dict(gamma=4), ValueError, "method 'ar' does not take gamma"),
    (dict(do_sample=True, temperature=0), ValueError, "temperature=0 with do_sample=True"),
    (dict(max_length=64), ValueError, "max_length is not supported: give max_new_tokens"),
    (dict(input_ids={"input_ids": [[3, 4, 5]], "attention_mask": [[0, 1, 1]]}), ValueError, "padding"),
    (dict(input_ids={"ids": [3, 4]}), ValueError, "needs an 'input_ids' entry"),
    (dict(input_ids=[[3, 4], [5, 6]]), ValueError, "a batch of 2"),
    (dict(input_ids=torch.tensor([3.0, 4.0])), ValueError, "integer token ids"),
    (dict(stop=[400]), ValueError, r"stop token id 400 is outside the vocabulary \[0, 320\)"),
    # garbage that used to be read as something else: bytes as ids, floats and bools truncated to ids
    (dict(input_ids=b"def f(x):"), ValueError, "input_ids is bytes: give text"),
    (dict(input_ids=[3, 4.7]), ValueError, r"integer token ids, got 4.7 \(float\) at position 1"),
    (dict(input_ids=[3, True]), ValueError, r"integer token ids, got True \(bool\) at position 1"),
    (dict(input_ids=["3"]), ValueError, r"integer token ids, got '3' \(str\) at position 0"),
    (dict(input_ids=torch.tensor([True, False])), ValueError, "integer token ids, got dtype torch.bool"),
    (dict(stop=[3.7]), ValueError, r"stop items must be token ids \(integers\) or strings, got 3.7 \(float\)"),
    (dict(stop=3.0), ValueError, r"got 3.0 \(float\)"),
    (dict(stop=[b"\n"]), ValueError, r"got b'\\n' \(bytes\)"),
])
def test_bad_input_is_named(raven, kwargs, error, message):
    args = dict(input_ids=TEXT, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        dasspec.generate(raven, **args)


def test_numpy_ids_are_taken_and_checked(raven):
    import numpy as np

    ids = raven.tokenizer.encode(TEXT)
    ref = dasspec.generate(raven, ids, max_new_tokens=3, eos=False).tokens
    assert dasspec.generate(raven, np.array(ids), max_new_tokens=3, eos=False).tokens == ref
    assert dasspec.generate(raven, [np.int64(t) for t in ids], max_new_tokens=3, eos=False).tokens == ref
    with pytest.raises(ValueError, match="integer token ids, got dtype torch.float64"):
        dasspec.generate(raven, np.array(ids, dtype=float), max_new_tokens=3)


def _with_generation_config(tmp_path, knobs: dict, sampled: dict | None = None):
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("raven-llama"))
    section = {"das-wave": knobs, **({"das-wave:sampled": sampled} if sampled is not None else {})}
    (folder / "generation_config.json").write_text(json.dumps({"dasspec": section}))
    return folder, dasspec.load_model(folder, device="cpu")


def test_a_bad_value_in_generation_config_names_the_file(tmp_path):
    """An out-of-range knob in a model folder's generation_config.json is reported as coming from that file; a
    conflict between it and the caller's knob names both; the caller's own mistake is reported as theirs."""
    folder, model = _with_generation_config(tmp_path, {"gamma": 0})
    path = re.escape(str(folder / "generation_config.json"))
    with pytest.raises(ValueError, match=f'^{path}: "dasspec" -> "das-wave": gamma must be an integer >= 1, got 0'):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2)
    with pytest.raises(ValueError, match="^rounds must be an integer >= 1, got 0$"):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2, rounds=0)
    assert dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2, gamma=4).stats.method == "das-wave"
    folder, model = _with_generation_config(tmp_path / "b", {"gamma": 4})
    with pytest.raises(ValueError, match=r'w_init \(9\) must be <= gamma \(4\) \(gamma=4 \("das-wave"\) from '
                                         r'.*generation_config'):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2, w_init=9)
    # the sampled section is named when its value is the bad one (and greedy decoding does not read it)
    folder, model = _with_generation_config(tmp_path / "c", {"gamma": 4}, sampled={"rounds": 0})
    assert dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2).stats.method == "das-wave"
    with pytest.raises(ValueError, match='"dasspec" -> "das-wave" and "das-wave:sampled": rounds must be'):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2, do_sample=True)


def test_a_malformed_generation_config_section_is_named(tmp_path):
    folder = write_checkpoint(tmp_path / "m", "raven-llama", vocab_size=320, mean_recurrence=3,
                              tokenizer=write_tokenizer("raven-llama"))
    (folder / "generation_config.json").write_text(json.dumps({"dasspec": {"das-wave": 8}}))
    model = dasspec.load_model(folder, device="cpu")
    with pytest.raises(ValueError, match='generation_config.json: "dasspec" must map method names to objects'):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2)
    (folder / "generation_config.json").write_text(json.dumps({"dasspec": {"das-wave": {"gama": 8}}}))
    model = dasspec.load_model(folder, device="cpu")
    with pytest.warns(UserWarning, match=r'"das-wave" sets gama, which das-wave does not take.*ignored'):
        dasspec.generate(model, TEXT, "das-wave", max_new_tokens=2)


def test_prompt_too_long_is_named(huginn):
    assert huginn.config.block_size == 64
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) = 65 exceeds the model "
                                         r"context of 64"):
        dasspec.generate(huginn, list(range(60)), max_new_tokens=5)
    assert len(dasspec.generate(huginn, list(range(60)), max_new_tokens=4, eos=False).tokens) == 4


def test_empty_text_without_bos_is_named(tmp_path):
    folder = write_checkpoint(tmp_path / "olmo", "raven-olmo", vocab_size=320, tokenizer=write_tokenizer("raven-olmo"))
    model = dasspec.load_model(folder, device="cpu")
    assert model.tokenizer.bos_id is None and model.tokenizer.encode("") == []       # OLMo adds no BOS
    with pytest.raises(ValueError, match="empty prompt"):
        dasspec.generate(model, "", max_new_tokens=3)


def test_text_prompt_without_tokenizer_is_named(tmp_path):
    model = dasspec.load_model(write_checkpoint(tmp_path / "m", "raven-olmo"), device="cpu")
    assert model.tokenizer is None
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        dasspec.generate(model, TEXT, max_new_tokens=3)


def test_model_default_w_init_fits_a_callers_smaller_gamma(raven, monkeypatch):
    """Tuned generation_config defaults (W_init 48) must not break a caller's gamma=6; an explicit W_init > gamma
    still fails with a message that names both."""
    from dasspec.methods import resolve_knobs

    monkeypatch.setattr(raven, "generation_defaults", {"dasspec": {"das-wave": {"gamma": 48, "w_init": 48}}})
    assert resolve_knobs(raven, "das-wave", {}, 3).w_init == 48
    assert resolve_knobs(raven, "das-wave", {"gamma": 6}, 3).w_init == 6
    ref = dasspec.generate(raven, TEXT, max_new_tokens=6, num_steps=3, eos=False)
    out = dasspec.generate(raven, TEXT, "das-wave", max_new_tokens=6, num_steps=3, eos=False, gamma=6, rounds=3)
    assert out.tokens == ref.tokens
    with pytest.raises(ValueError, match=r"w_init \(8\) must be <= gamma \(6\)"):
        dasspec.generate(raven, TEXT, "das-wave", max_new_tokens=6, num_steps=3, gamma=6, w_init=8)


def test_model_default_seed_branch_yields_to_a_callers_anchor_window(raven, monkeypatch):
    """A tuned seed branch (copy seeds) is dropped when the caller asks for the paper's anchor-seeded window, and
    asking for both explicitly is an error that says why."""
    from dasspec.methods import resolve_knobs

    monkeypatch.setattr(raven, "generation_defaults",
                        {"dasspec": {"das-wave": {"guesses": "copy", "seed_branch": 24}}})
    assert resolve_knobs(raven, "das-wave", {}, 3).seed_branch == 24
    assert resolve_knobs(raven, "das-wave", {"guesses": "anchor"}, 3).seed_branch == 0
    with pytest.raises(ValueError, match="seed_branch needs a seed"):
        dasspec.generate(raven, TEXT, "das-wave", max_new_tokens=6, num_steps=3, guesses="anchor", seed_branch=4)


def test_stopping_criteria_end_every_method_at_the_same_token():
    """Hugging Face-style stopping criteria are asked after every committed token - also inside a verified chunk -
    with the prompt and the output so far, so every method stops exactly where AR does."""
    from dasspec.methods import method_names
    from dasspec.testing import random_model

    model = random_model("huginn", mean_recurrence=16)
    prompt = [5, 9, 13, 7, 22, 31] * 3
    ref = dasspec.generate(model, prompt, "ar", max_new_tokens=24, eos=False).tokens
    j = next(j for j in range(8, 24) if ref[j] not in ref[:j])   # a token first produced mid-generation
    seen = []

    def at_token(input_ids, scores):                             # returns a BoolTensor [B], as HF criteria may
        seen.append(input_ids.shape)
        assert scores is None and input_ids[0, : len(prompt)].tolist() == prompt
        return input_ids[:, -1] == ref[j]

    for method in method_names():
        seen.clear()
        out = dasspec.generate(model, prompt, method, max_new_tokens=24, eos=False, stopping_criteria=[at_token])
        assert out.tokens == ref[: j + 1], method
        assert out.stats.stop_reason == "stopping_criteria", method
        assert seen[-1] == (1, len(prompt) + j + 1), method
    with pytest.raises(TypeError, match="stopping_criteria must be callables"):
        dasspec.generate(model, prompt, max_new_tokens=4, stopping_criteria=["stop"])


def test_hugging_face_no_op_options_are_accepted(raven):
    a = dasspec.generate(raven, TEXT, max_new_tokens=4, eos=False).tokens
    b = dasspec.generate(raven, TEXT, max_new_tokens=4, eos=False, do_sample=False, num_beams=1).tokens
    assert a == b


def test_hugging_face_prompt_forms(raven):
    """What a Hugging Face tokenizer returns - a BatchEncoding-like mapping, nested lists, [1, T] tensors - works."""
    ids = raven.tokenizer.encode(TEXT)
    ref = dasspec.generate(raven, ids, max_new_tokens=4, eos=False).tokens
    for form in ({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}, [ids],
                 torch.tensor([ids]), tuple(ids)):
        assert dasspec.generate(raven, form, max_new_tokens=4, eos=False).tokens == ref
