"""One rank of the Python tests' training runs: a small torch model trained with AdamW on data of
its own (a function of the rank and the step), synchronised by pulseloco.Synchronizer.

Prints one JSON line per event on stdout ({"event": "window", "digest": ...}, {"event": "done",
...}); the tests compare them across ranks. The group forms from the environment.
"""

import argparse
import json
import sys
import time

import torch

import pulseloco


def emit(**fields):
    print(json.dumps(fields), flush=True)


def emit_error(error, **fields):
    emit(event="error", type=type(error).__name__, kind=getattr(error, "kind", None),
         rank_context=getattr(error, "rank", None), peer=getattr(error, "peer", None),
         tensor=getattr(error, "tensor", None), index=getattr(error, "index", None),
         ranks=list(getattr(error, "ranks", [])), message=str(error), **fields)


def rank_and_window(text):
    """"R:W" -> (R, W); None -> (None, None)."""
    if text is None:
        return None, None
    rank, window = text.split(":")
    return int(rank), int(window)


def batch(rank, step, dtype):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return x.to(dtype), y.to(dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="pulse")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--overlap", default="blocking",
                        help="overlapped windows: the last one is applied by complete_in_flight()")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--save", help="checkpoint root: save after --save-after windows")
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--resume", help="checkpoint to load before training")
    parser.add_argument("--coordinator", help="an elastic worker of this coordinator")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--announce", action="store_true",
                        help="print an 'entering' event before each window")
    parser.add_argument("--perturb", metavar="R:W",
                        help="rank R adds 1 to a weight before window W (replicas diverge)")
    parser.add_argument("--infinity", metavar="R:W",
                        help="rank R sets weight [0] index 5 to infinity before window W")
    args = parser.parse_args()

    torch.manual_seed(7)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elastic = None
    if args.coordinator:
        elastic = {"coordinator": args.coordinator, "worker_id": args.worker_id,
                   "admission_timeout": 60.0}
    sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                  inner_steps=args.inner_steps, threads=1,
                                  timeout=args.timeout, elastic=elastic, overlap=args.overlap)
    rank = sync.rank
    pointers = [info.data_ptr for info in sync.tensor_table()]
    emit(event="ready", rank=rank, world_size=sync.world_size,
         zero_copy=pointers == [p.data_ptr() for p in model.parameters()])
    step = 0
    if args.resume:
        loaded = sync.load_checkpoint(args.resume, optimizer=optimizer)
        step = loaded.next_step  # the documented way: where the data continues
        emit(event="loaded", rank=rank, window=loaded.window, next_window=loaded.next_window,
             next_step=loaded.next_step)
    try:
        train(args, sync, model, optimizer, dtype, step)
    except KeyboardInterrupt:
        emit(event="interrupted", rank=rank)
        try:
            sync.run_window()
        except pulseloco.Error as error:  # the group is gone: AbortedError
            emit_error(error, after="interrupt")
        return 4
    except pulseloco.Error as error:
        emit_error(error, elapsed=time.monotonic() - train.window_start)
        return 3
    completed = sync.complete_in_flight()
    if completed is not None:
        emit(event="completed", rank=rank, window=completed.window,
             applied_window=completed.applied_window, digest=completed.digest,
             replicas_identical=completed.replicas_identical,
             in_flight=sync.window_in_flight, again=sync.complete_in_flight() is not None)
    emit(event="done", rank=rank, window=sync.committed_windows, digest=sync.digest,
         weights=[p.detach().float().sum().item() for p in model.parameters()])
    sync.close()
    return 0


def train(args, sync, model, optimizer, dtype, step):
    rank = sync.rank
    perturb_rank, perturb_window = rank_and_window(args.perturb)
    infinity_rank, infinity_window = rank_and_window(args.infinity)
    train.window_start = time.monotonic()
    first = next(model.parameters())
    # Windows whose inner steps have ended (with overlapped windows one more than
    # sync.committed_windows).
    ended = sync.next_window
    while ended < args.windows:
        x, y = batch(rank, step, dtype)
        loss = ((model(x) - y) ** 2).mean()  # mse_loss has no bf16 kernel on the CPU in torch 1.13
        loss.backward()
        sync.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if sync.next_step_runs_window:
            with torch.no_grad():
                if (rank, sync.committed_windows) == (perturb_rank, perturb_window):
                    first.view(-1)[0] += 1.0
                if (rank, sync.committed_windows) == (infinity_rank, infinity_window):
                    first.view(-1)[5] = float("inf")
            if args.announce:
                emit(event="entering", rank=rank, window=sync.committed_windows)
            train.window_start = time.monotonic()
        report = sync.after_optimizer_step()
        if report is None:
            continue
        ended = report.window + 1
        emit(event="window", rank=rank, window=report.window, mode=report.mode,
             overlap=report.overlap, applied_window=report.applied_window,
             digest=report.digest, replicas_identical=report.replicas_identical,
             payload_bytes=report.payload_bytes, loss=float(loss),
             generation=report.generation, members=report.members)
        if args.save and sync.committed_windows == args.save_after:
            path = sync.save_checkpoint(args.save, optimizer=optimizer)
            emit(event="saved", rank=rank, path=str(path))


if __name__ == "__main__":
    sys.exit(main())
