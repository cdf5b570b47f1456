"""The files of a Nanbeige4.2 repository without its weights, for ``benchmarks/real_shapes.py --layout nanbeige``
(and the mid-size peers comparison, ``--preset mid``): config.json with the published Nanbeige4.2-3B fields, a
two-shard model.safetensors.index.json, a stand-in tokenizer with the real vocabulary size and special ids, the
ChatML chat template with the thinking switch, and generation_config.json.  ``dasspec.testing
build_real_checkpoint`` then writes random weights into that layout.

What is the real checkpoint's and what is not:

* config.json: the published Nanbeige4.2-3B values (vocab 166,144, width 3072, 22 layers x 2 loops, 48 query / 8
  key-value heads of 128, MLP 10,752, rope_theta 7e7, 262,144 positions, rms eps 1e-5, untied head, special ids
  166100 / 166101 / 0), every field the published file carries.  ``--layers`` keeps fewer of the 22 layers (the
  real width, a shorter stack: what fits this machine), ``--preset mid`` is the peers' mid-size shape (width 512,
  8 layers x 2 loops, 8 / 2 heads of 128, the real vocabulary).
* the shard index: the published file splits 3B into two shards; here tensors alternate between two shards (the
  real assignment is not needed to test the loader, only that an index with two files is read).
* the tokenizer: a stand-in (the real tokenizer.json is 17 MB of merges): the real vocabulary size and the real
  ids of <unk> 0, <s> 1, </s> 2, byte pieces <0x00>..<0xFF> 3..258, <|im_start|> 166100 (BOS, added by the
  tokenizer's template as the real one does), <|im_end|> 166101 (EOS), <|endoftext|> 166102, <think> 166103,
  </think> 166104, <tool_call> 166105, </tool_call> 166106; single-character pieces (the word marker and printable
  ASCII) and no merges, so text encodes to about a token per character; the ids past 166106 are padding pieces.

    python benchmarks/nanbeige_files.py --out /tmp/dasspec-big/nanbeige-files --layers 4
    python benchmarks/nanbeige_files.py --out /tmp/dasspec-big/nanbeige-mid-files --preset mid
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PUBLISHED = {
    "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige",
    "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig", "AutoModel": "modeling_nanbeige.NanbeigeModel",
                 "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
    "vocab_size": 166144, "hidden_size": 3072, "intermediate_size": 10752, "num_hidden_layers": 22,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "kv_channels": 128, "hidden_act": "silu",
    "max_position_embeddings": 262144, "rope_theta": 70000000, "rope_scaling": None, "attention_bias": False,
    "attention_dropout": 0.0, "rms_norm_eps": 1e-05, "num_loops": 2, "loop_loss_weights": [],
    "skip_loop_final_norm": False, "pretraining_tp": 1, "tie_word_embeddings": False, "pad_token_id": 0,
    "bos_token_id": 166100, "eos_token_id": 166101, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}
MID = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
           kv_channels=128, intermediate_size=1536, max_position_embeddings=4096, torch_dtype="float32")
SPECIALS = {166100: "<|im_start|>", 166101: "<|im_end|>", 166102: "<|endoftext|>", 166103: "<think>",
            166104: "</think>", 166105: "<tool_call>", 166106: "</tool_call>"}
GENERATION = {"bos_token_id": 166100, "do_sample": True, "eos_token_id": 166101, "pad_token_id": 0,
              "temperature": 0.6, "top_k": 20, "top_p": 0.95}
# ChatML with the thinking switch: the generation prompt opens a <think> block, or closes an empty one when the
# request passes enable_thinking=false (a shortened form of the published template, without the tool-call branch).
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581"] + [chr(c) for c in range(33, 127)]:      # the word marker and printable ASCII
        vocab[piece] = len(vocab)
    for i in range(len(vocab), min(SPECIALS)):
        vocab[f"<|filler_{i}|>"] = i               # ids the stand-in never produces (the real merges' pieces)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(SPECIALS[i], special=i <= 166102, normalized=False) for i in sorted(SPECIALS)])
    # the rows past the last named token, as padding pieces: llama.cpp's converter sizes its vocabulary from the
    # tokenizer and needs one entry per embedding row (the real repository's SentencePiece path pads the same way)
    tok.add_tokens([AddedToken(f"<|pad_{i}|>", special=True, normalized=False)
                    for i in range(max(SPECIALS) + 1, vocab_size)])
    assert all(tok.token_to_id(t) == i for i, t in SPECIALS.items()) and tok.get_vocab_size() == vocab_size
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 166100)])
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<unk>", "unk_token": "<unk>",
              "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2),
            "special_tokens_map.json": json.dumps({k: config[k] for k in ("bos_token", "eos_token", "pad_token",
                                                                           "unk_token")}, indent=2),
            "chat_template.jinja": CHAT_TEMPLATE, "generation_config.json": json.dumps(GENERATION, indent=2)}


def write_files(out: Path, layers: int | None = None, preset: str = "3b") -> Path:
    cfg = dict(PUBLISHED, **(MID if preset == "mid" else {}))
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        names += [f"model.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {n: shards[k % 2] for k, n in enumerate(sorted(names))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for name, text in tokenizer_files(cfg["vocab_size"]).items():
        (out / name).write_text(text)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=None, help="keep this many of the layers (default: all)")
    p.add_argument("--preset", choices=("3b", "mid"), default="3b")
    args = p.parse_args()
    print(write_files(Path(args.out), args.layers, args.preset))


if __name__ == "__main__":
    main()
