"""Post-train a transformers causal LM on several workers, synchronised by pulseloco in the PULSE
authors' configuration: bf16 weights, AdamW, bf16_delta="authors".

    .venv/bin/python -m pulseloco.launch --nproc-per-node 2 examples/python/train_hf.py
    torchrun --nproc-per-node 2 examples/python/train_hf.py --size 0.5b --device cuda

The model is a Qwen2-architecture config built here (--size: tiny, small, or 0.5b, the shape of
Qwen2.5-0.5B), randomly initialised with the same seed on every worker, in bf16. Each worker
trains with AdamW on sequences of its own whose second half repeats the first; every H steps
pulseloco runs a window (--mode pulse, diloco or ddp). At the default learning rate about 2% of
the elements fire per window, the paper's regime; from a random initialisation the loss barely
moves at that rate: the example shows the synchronisation, not a useful model. Rank 0 prints a line per window: training loss, density, the payload per worker
against what DiLoCo and DDP would send, the window's phase times and the digest of the global
weights. With --json every rank prints one JSON object per window instead (its rank, window,
digest, density, bytes and phase times). The exit status is 3 when the replicas differed.

--device cuda keeps the model on the GPU (state on the device unless --state-location host);
several processes may share one GPU (rank r uses GPU r mod the visible count).
"""

from __future__ import annotations

import argparse
import json
import os

# The engine's per-rank report lines would interleave with rank 0's table; warnings and errors
# still show (PULSELOCO_LOG_LEVEL overrides).
os.environ.setdefault("PULSELOCO_LOG_LEVEL", "warn")

import torch  # noqa: E402

import pulseloco  # noqa: E402

# Qwen2 shapes: vocabulary, hidden, intermediate, layers, attention heads, key-value heads.
SIZES = {
    "tiny": (512, 64, 176, 2, 4, 2),
    "small": (4096, 256, 704, 4, 4, 2),
    "0.5b": (151936, 896, 4864, 24, 14, 2),  # Qwen2.5-0.5B
}


def build_model(size: str, sequence: int, seed: int):
    """A randomly initialised Qwen2ForCausalLM of the given size, in bf16."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError as error:
        raise SystemExit(f"train_hf.py needs transformers with Qwen2 (4.37 or later): {error}")
    vocab, hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max(sequence, 64),
                         tie_word_embeddings=True)
    torch.manual_seed(seed)  # the same weights on every worker (rank 0's win at the join anyway)
    return Qwen2ForCausalLM(config).to(torch.bfloat16), vocab


def repeat_batch(generator: torch.Generator, batch: int, sequence: int, vocab: int,
                 device: torch.device) -> torch.Tensor:
    """Token sequences whose second half repeats the first."""
    half = torch.randint(0, vocab, (batch, sequence // 2), generator=generator)
    return torch.cat([half, half], dim=1).to(device)


def human_bytes(count: float) -> str:
    """Decimal units, as the engine's own summary line writes them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count:.0f} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--mode", choices=["pulse", "diloco", "ddp"], default="pulse")
    parser.add_argument("--overlap", choices=["blocking", "delayed", "eager"], default="blocking",
                        help="overlapped windows (mode pulse)")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("-H", "--inner-steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-6,
                        help="AdamW's learning rate (3e-6: about 2% of the elements fire)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step and worker")
    parser.add_argument("--sequence", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--state-location", choices=["automatic", "device", "host"],
                        default="automatic")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and engine threads per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true",
                        help="every rank prints one JSON object per window")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model, vocab = build_model(args.size, args.sequence, args.seed)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                  inner_steps=args.inner_steps, overlap=args.overlap,
                                  bf16_delta="authors", state_location=args.state_location,
                                  threads=args.threads)
    rank = sync.rank
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank + 1)  # this worker's
    if rank == 0 and not args.json:
        print(f"{args.mode}: {sync.world_size} workers, Qwen2 {args.size}, "
              f"{sync.parameter_count} parameters in bf16, H={args.inner_steps}, state on "
              f"{sync.state_location}", flush=True)

    payload = diloco = ddp = 0
    identical = True

    def account(report: pulseloco.WindowReport, train_loss: float | None) -> None:
        """train_loss: None for the report of complete_in_flight, which sends nothing."""
        nonlocal payload, diloco, ddp, identical
        if train_loss is not None:
            payload += report.payload_bytes
            diloco += report.diloco_bytes
            ddp += report.ddp_bytes
        identical = identical and report.replicas_identical
        seconds = report.seconds
        if args.json:
            print(json.dumps({"rank": rank, "window": report.window,
                              "applied_window": report.applied_window, "digest": report.digest,
                              "loss": train_loss, "density": report.density,
                              "payload_bytes": report.payload_bytes,
                              "diloco_bytes": report.diloco_bytes, "ddp_bytes": report.ddp_bytes,
                              "seconds": report.to_dict()["seconds"],
                              "state_location": report.state_location}), flush=True)
        elif rank == 0:
            loss = "" if train_loss is None else f"train loss {train_loss:.4f}, "
            print(f"window {report.window}: {loss}density {report.density:.2%}, payload "
                  f"{human_bytes(report.payload_bytes)} (DiLoCo "
                  f"{report.diloco_bytes / max(report.payload_bytes, 1):.1f}x, DDP "
                  f"{report.ddp_bytes / max(report.payload_bytes, 1):.1f}x), gate "
                  f"{seconds.gate:.3f} s, exchange {seconds.exchange:.3f} s, apply "
                  f"{seconds.apply:.3f} s, digest {report.digest}", flush=True)

    for _ in range(args.windows):
        train_loss = 0.0
        report = None
        for _ in range(args.inner_steps):
            tokens = repeat_batch(generator, args.batch, args.sequence, vocab, device)
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad()
            loss.backward()
            sync.before_optimizer_step()  # ddp: averages the gradients
            optimizer.step()
            report = sync.after_optimizer_step()  # a window every H steps
            train_loss += loss.item() / args.inner_steps
        assert report is not None, "a window runs every H steps"
        account(report, train_loss)

    last = sync.complete_in_flight()  # overlapped windows: apply the last one
    if last is not None:
        account(last, None)
    if rank == 0 and not args.json:
        print(f"summary: {args.windows} windows, payload per worker {human_bytes(payload)} "
              f"(DiLoCo would send {diloco / max(payload, 1):.1f}x, DDP "
              f"{ddp / max(payload, 1):.1f}x), replicas "
              f"{'bit-identical every window' if identical else 'DIFFERED'}", flush=True)
    sync.close()
    return 0 if identical else 3


if __name__ == "__main__":
    raise SystemExit(main())
