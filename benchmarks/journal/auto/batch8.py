"""The closed batch the issue-37 scripts here decode: 8 GSM8K questions on a random Ouro folder, one thread.
``setup(parser)`` adds --model and --data to ``parser``, parses, and returns (args, model, prompts)."""
import argparse, json, os, torch, dasspec


def setup(parser: argparse.ArgumentParser):
    parser.add_argument("--model", default="/tmp/dasspec-auto-models/ouro-small")
    parser.add_argument("--data", default=os.environ.get("DASSPEC_DATA", "../shared/data"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = dasspec.load_model(args.model, dtype=torch.float32)
    qs = [json.loads(l)["question"] for l in open(os.path.join(args.data, "gsm8k", "test.jsonl"))][:8]
    return args, model, [model.tokenizer.encode(q) for q in qs]
