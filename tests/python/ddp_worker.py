"""One rank of the tests of workers of several ranks (test_workers.py).

Worker mode (--ranks-per-worker G): torch.distributed over every rank (gloo), DDP inside each
worker of G ranks, pulseloco.Synchronizer(worker=...) between workers; local rank j trains on
micro-batch j of its worker's batch.

Elastic worker mode (--ranks-per-worker G --coordinator ADDR --worker-id ID): torch.distributed
over this worker's G ranks only (each worker its own group), pulseloco.Synchronizer(worker=G,
elastic=...) between the workers a `pulseloco coordinator` admits.

Reference mode (--micro-batches G): one rank per worker, no torch.distributed. It computes the
gradient of each of its worker's G micro-batches and averages them as DDP does (each multiplied
by 1/G, then summed in local rank order), and synchronises with a plain Synchronizer.

The weights start away from zero (magnitudes 0.5 to 1) and AdamW's steps are small (lr 1e-3),
so every pseudo-gradient element is small against its weight; the reference run reports the
largest ratio before each window ("gap"), which the tests check.

Prints one JSON line per event on stdout.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch

import pulseloco


def emit(**fields):
    print(json.dumps(fields), flush=True)


def failed(worker_mode):
    """Exit status 3. A rank of torch.distributed leaves without the interpreter's teardown:
    torch aborts it ("terminate called without an active exception") where the default gloo
    group was not destroyed, at random, and destroying the group can wait on a collective that
    a failed peer left."""
    if worker_mode:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    return 3


def batch(worker, step, micro):
    generator = torch.Generator().manual_seed(100000 * worker + 100 * step + micro)
    x = torch.randn(8, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def build_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            magnitude = torch.rand(parameter.shape, generator=generator) * 0.5 + 0.5
            sign = torch.randint(0, 2, parameter.shape, generator=generator) * 2 - 1
            parameter.copy_(magnitude * sign)
    return model


def parameters_sha(model):
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().view(-1).view(torch.int16 if parameter.dtype ==
                                                       torch.bfloat16 else torch.int32)
                      .numpy().tobytes())
    return digest.hexdigest()


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="pulse")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--ranks-per-worker", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--announce", action="store_true",
                        help="print an 'entering' event before each window")
    parser.add_argument("--save", help="checkpoint root: save after --save-after windows")
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--resume", help="checkpoint root to load before training")
    parser.add_argument("--trace-dir", default="", help="the engine's trace_dir")
    parser.add_argument("--overlap", default="blocking")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--coordinator", help="elastic: the coordinator's host:port")
    parser.add_argument("--worker-id", help="elastic: this worker's id")
    parser.add_argument("--worker-link-timeout", type=float,
                        help="elastic: how long a local rank waits for the others (s)")
    parser.add_argument("--no-ddp", action="store_true",
                        help="worker mode without DDP: every local rank trains on micro-batch 0, "
                        "so the worker's replicas take the same steps (gloo has no bf16 DDP)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = build_model().to(dtype)
    # Under the launcher's --ranks-per-worker, the Synchronizer takes G from the environment.
    worker_mode = args.ranks_per_worker > 0 or bool(os.environ.get("PULSELOCO_RANKS_PER_WORKER"))
    if worker_mode:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        elastic = None
        if args.coordinator:
            elastic = {"coordinator": args.coordinator, "worker_id": args.worker_id,
                       "admission_timeout": 240.0}
            if args.worker_link_timeout:
                elastic["worker_link_timeout"] = args.worker_link_timeout
        try:
            sync = pulseloco.Synchronizer(
                model.named_parameters(), mode=args.mode, inner_steps=args.inner_steps,
                threads=1, timeout=args.timeout, worker=args.ranks_per_worker or None,
                trace_dir=args.trace_dir, overlap=args.overlap, elastic=elastic)
        except pulseloco.Error as error:
            emit(event="error", type=type(error).__name__, message=str(error), elapsed=0.0)
            return failed(worker_mode)
        layout = sync.worker
        worker, local, micro_batches = layout.worker, layout.local_rank, 1
        if args.no_ddp:
            trained = model
        else:
            trained = torch.nn.parallel.DistributedDataParallel(
                model, process_group=sync.process_group)
    else:
        sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                      inner_steps=args.inner_steps, threads=1,
                                      timeout=args.timeout)
        worker, local, micro_batches = sync.rank, 0, args.micro_batches
        trained = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    emit(event="ready", rank=sync.rank, worker=worker, local_rank=local, digest=sync.digest,
         parameter_count=sync.parameter_count)
    step = 0
    if args.resume:
        loaded = sync.load_checkpoint(args.resume, optimizer=optimizer)
        step = loaded.next_step
        emit(event="loaded", rank=sync.rank, window=loaded.window, digest=sync.digest,
             parameters=parameters_sha(model))
    start = time.monotonic()
    try:
        while sync.committed_windows < args.windows:
            if micro_batches == 1:
                micro = 0 if args.no_ddp else local
                x, y = (t.to(dtype) for t in batch(worker, step, micro))
                loss_of(trained, x, y).backward()
            else:
                parameters = list(model.parameters())
                total = None
                for micro in range(micro_batches):
                    x, y = batch(worker, step, micro)
                    grads = torch.autograd.grad(loss_of(model, x, y), parameters)
                    scaled = [g * (1.0 / micro_batches) for g in grads]
                    total = scaled if total is None else [t + s for t, s in zip(total, scaled)]
                for parameter, grad in zip(parameters, total):
                    parameter.grad = grad
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if sync.next_step_runs_window:
                if not worker_mode:
                    emit(event="gap", window=sync.committed_windows, **gap(sync, model))
                if args.announce:
                    emit(event="entering", rank=sync.rank, window=sync.committed_windows)
                start = time.monotonic()
            report = sync.after_optimizer_step()
            if report is None:
                continue
            emit(event="window", rank=sync.rank, window=report.window, digest=sync.digest,
                 share_digest=report.digest, parameters=parameters_sha(model),
                 payload_bytes=report.payload_bytes, world_size=report.world_size,
                 members=list(report.members), generation=report.generation)
            if args.save and sync.committed_windows == args.save_after:
                sync.save_checkpoint(args.save, optimizer=optimizer)
                emit(event="saved", rank=sync.rank)
    except pulseloco.Error as error:
        emit(event="error", rank=sync.rank, type=type(error).__name__, message=str(error),
             peer=getattr(error, "peer", None), elapsed=time.monotonic() - start)
        return failed(worker_mode)
    count = len(sync.tensor_table())
    emit(event="done", rank=sync.rank, worker=worker, local_rank=local, digest=sync.digest,
         parameters=parameters_sha(model),
         global_weights="".join(sync.global_weights(i).tobytes().hex() for i in range(count)),
         momentum="".join(sync.momentum(i).tobytes().hex() for i in range(count)))
    sync.close()
    if worker_mode:
        dist.destroy_process_group()
    return 0


def gap(sync, model):
    """The largest |theta_l - theta_g| / |theta_g| and the smallest |theta_g| (reference mode,
    where this rank holds every tensor)."""
    largest, smallest = 0.0, float("inf")
    for i, parameter in enumerate(model.parameters()):
        global_weights = torch.from_numpy(sync.global_weights(i)).view(parameter.shape)
        ratio = (parameter.detach() - global_weights).abs() / global_weights.abs()
        largest = max(largest, float(ratio.max()))
        smallest = min(smallest, float(global_weights.abs().min()))
    return {"largest_ratio": largest, "smallest_weight": smallest}


if __name__ == "__main__":
    sys.exit(main())
