"""Where the fast and eager engines part at one decode step (issue 10 item 6): logits and router picks.

    python benchmarks/diagnose_divergence.py --page datasets/samples/scan_exif_rotated.jpg --step 64 \
        [--dtype float32] [--out DIR]

Both engines' sessions of the `full` preset (RANDOM WEIGHTS, seed 0) run the same cache-free forward
(`engine.verify.one_shot_scores`) over the page's prompt and eager's greedy tokens up to `--step`, with a
hook on every MoE layer's router. Printed and written (divergence.json in --out):
  - per step, the largest |eager − fast| logit (finite ones) and how many tokens one bans and the other not;
  - at `--step`, both engines' top 3 tokens and logits;
  - per MoE layer, at `--step`'s position: whether the two picked the same experts, the gap between the
    6th and 7th expert probabilities in eager's router (a gap near 0 is a tie either pick is right for),
    the largest router-logit difference, and how many positions of the whole sequence picked different
    experts.
A divergence where one layer's expert choice flips at a near-tie is rounding meeting a discrete choice;
one with the same experts everywhere and a logit gap beyond the dtype's rounding is a defect to chase.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_engine import environment  # noqa: E402
from dsocr_workers.engine.result import DecodeOptions  # noqa: E402
from dsocr_workers.engine.session import DeepSeekOCRSession  # noqa: E402
from dsocr_workers.engine.verify import one_shot_scores  # noqa: E402

OPTIONS = DecodeOptions(ignore_eos=True)


def scores_and_routes(
    session: DeepSeekOCRSession, page: Path, tokens: list[int]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One-shot scores [steps, vocab] and, per MoE layer, (router logits [T, E], picked experts [T, k])."""
    routes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(_module: Any, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        routes.append((output[0].detach().float().cpu(), output[2].detach().cpu()))

    layers = session.model.language_model.layers
    hooks = [layer.mlp.gate.register_forward_hook(keep) for layer in layers if hasattr(layer.mlp, "gate")]
    try:
        scores = one_shot_scores(session, page, tokens, OPTIONS)
    finally:
        for hook in hooks:
            hook.remove()
    return scores, routes


def diagnose(args: argparse.Namespace) -> dict[str, Any]:
    sessions = {engine: DeepSeekOCRSession.from_local(args.model, device=args.device, dtype=args.dtype, engine=engine)
                for engine in ("eager", "fast")}  # fmt: skip
    reference = sessions["eager"].run_inference(args.page, mode="gundam", max_new_tokens=args.step + 1, infer=OPTIONS)
    tokens = reference.token_ids
    (eager, eager_routes), (fast, fast_routes) = (scores_and_routes(s, args.page, tokens) for s in sessions.values())
    finite = torch.isfinite(eager) & torch.isfinite(fast)
    logit_diff = torch.where(finite, (eager - fast).abs(), torch.zeros_like(eager)).amax(dim=-1)
    row = reference.prompt_tokens - 1 + args.step
    layers = []
    for index, ((eager_logits, eager_experts), (fast_logits, fast_experts)) in enumerate(
        zip(eager_routes, fast_routes, strict=True)
    ):
        top_k = eager_experts.shape[1]
        probabilities = eager_logits[row].softmax(-1).sort(descending=True).values
        layers.append({
            "layer": index,
            "same_experts": set(eager_experts[row].tolist()) == set(fast_experts[row].tolist()),
            "eager_kth_minus_next_probability": float(probabilities[top_k - 1] - probabilities[top_k]),
            "router_logit_max_diff": float((eager_logits[row] - fast_logits[row]).abs().max()),
            "positions_with_other_experts": sum(
                set(a.tolist()) != set(b.tolist()) for a, b in zip(eager_experts, fast_experts, strict=True)
            ),
            "positions": int(eager_experts.shape[0]),
        })  # fmt: skip

    def top3(scores: torch.Tensor) -> dict[str, list]:
        best = scores[args.step].topk(3)
        return {"tokens": best.indices.tolist(), "logits": best.values.tolist()}

    return {
        "model": sessions["eager"].source.label, "page": str(args.page), "step": args.step, "dtype": args.dtype,
        "eager_split_token": tokens[args.step], "eager_top3": top3(eager), "fast_top3": top3(fast),
        "max_logit_diff_per_step": logit_diff.tolist(),
        "ban_differs_per_step": (torch.isfinite(eager) != torch.isfinite(fast)).sum(dim=-1).tolist(),
        "layers": layers,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=REPO / "datasets" / "samples" / "scan_exif_rotated.jpg")
    parser.add_argument("--step", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    report = {"environment": environment(), "command": shlex.join(["python", *sys.argv]), **diagnose(args)}
    diffs = report["max_logit_diff_per_step"]
    print("max |eager - fast| logit per step:", " ".join(f"{d:.1e}" for d in diffs))
    print("steps where the bans differ:", [k for k, n in enumerate(report["ban_differs_per_step"]) if n])
    print(f"step {args.step}: eager split token {report['eager_split_token']}; "
          f"eager top 3 {report['eager_top3']}; fast top 3 {report['fast_top3']}")  # fmt: skip
    for layer in report["layers"]:
        print(f"layer {layer['layer']:2d}: same experts {layer['same_experts']!s:5}  k-th − next expert "
              f"probability {layer['eager_kth_minus_next_probability']:.2e}  router logit diff "
              f"{layer['router_logit_max_diff']:.1e}  positions with other experts "
              f"{layer['positions_with_other_experts']} / {layer['positions']}")  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "divergence.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
