"""``pagoda bench disagg``: goodput of disaggregated prefill/decode vs colocated, simulated.

For each device count and arrival rate, the same workload (long shared-nothing prompts,
moderate outputs; ``WorkloadConfig`` with one prompt per tenant so no prefix is shared)
runs on ``N`` colocated replicas and on every prefill/decode split ``P + D = N`` of
``--splits`` (fractions of N for prefill); the table gives each configuration's SLO
attainment and, per device count, the goodput (highest rate with >= 90% attainment),
as DistServe reports it. The SLOs default to multiples of an unloaded request's prefill
time and decode step under the step-time model (``--slo-scale``). Everything runs in the
calibrated simulator (``pagoda.fleet.sim.disagg``): the real scheduler, the real routing
decision path, a modelled step time and transfer. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

from pagoda.fleet.routing.policy import make_policy
from pagoda.fleet.sim.disagg import DisaggSimulator, Slo, TransferModel, goodput
from pagoda.fleet.sim.simulator import (DEFAULT_STEP_MODEL, ReplicaConfig, StepTimeModel, WorkloadConfig,
                                        make_workload)


def default_slo(step: StepTimeModel, prompt_tokens: int, scale: float, itl_scale: float = 0.0) -> Slo:
    """``scale`` x an unloaded request's prefill (TTFT) and one-sequence decode step (TPOT);
    with ``itl_scale``, also a bound on every inter-token gap (``itl_scale`` x that step)."""
    prefill = step.step_time(prompt_tokens, prompt_tokens)
    decode = step.step_time(1, prompt_tokens)
    return Slo(ttft_s=scale * prefill, tpot_s=scale * decode,
               max_itl_s=itl_scale * decode if itl_scale > 0 else float("inf"))


def run_table(devices: list[int], rates_per_device: list[float], splits: list[float], workload: WorkloadConfig,
              slo: Slo, transfer: TransferModel, step: StepTimeModel = DEFAULT_STEP_MODEL,
              replica: Optional[ReplicaConfig] = None, policy: str = "prefix_aware") -> list[dict]:
    """One row per (devices, rate): colocated attainment and the best split's."""
    rows, replica = [], replica or ReplicaConfig()
    for n in devices:
        for per_device in rates_per_device:
            rate = per_device * n
            requests = make_workload(WorkloadConfig(**{**workload.__dict__, "arrival_rate": rate}))
            colocated = DisaggSimulator(0, n, make_policy(policy), step, replica).run(requests).attainment(slo)
            best = (0.0, "")
            for fraction in splits:
                p = min(n - 1, max(1, round(fraction * n)))
                sim = DisaggSimulator(p, n - p, make_policy(policy), step, replica, transfer=transfer)
                value = sim.run(requests).attainment(slo)
                if value > best[0] or not best[1]:
                    best = (value, f"{p}P+{n - p}D")
            rows.append({"devices": n, "rate": rate, "colocated": colocated, "disaggregated": best[0],
                         "split": best[1]})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| devices | rate (req/s) | colocated attainment | disaggregated attainment (best split) |",
             "|---|---|---|---|"]
    lines += [f"| {r['devices']} | {r['rate']:.2f} | {r['colocated']:.0%} | {r['disaggregated']:.0%} ({r['split']}) |"
              for r in rows]
    for n in sorted({r["devices"] for r in rows}):
        mine = [r for r in rows if r["devices"] == n]
        co = goodput({r["rate"]: r["colocated"] for r in mine})
        dis = goodput({r["rate"]: r["disaggregated"] for r in mine})
        lines.append(f"\ngoodput at {n} devices (highest rate with >= 90% attainment): colocated {co:.2f} req/s, "
                     f"disaggregated {dis:.2f} req/s")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="8,16", help="device counts, comma-separated")
    p.add_argument("--rates-per-device", default="0.02,0.04,0.06,0.08,0.1,0.12",
                   help="arrival rates per device (req/s), comma-separated")
    p.add_argument("--splits", default="0.25,0.5,0.75", help="prefill share of the devices to try")
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--slo-scale", type=float, default=4.0, help="SLOs as multiples of an unloaded request's")
    p.add_argument("--itl-scale", type=float, default=0.0,
                   help="also bound every inter-token gap by this multiple of an unloaded decode step (0: off)")
    p.add_argument("--transfer-mb-s", type=float, default=300.0)
    p.add_argument("--block-bytes", type=int, default=737_280, help="KV bytes per block (default: SmolLM2 fp32)")
    p.add_argument("--transfer-latency-s", type=float, default=0.005)
    p.add_argument("--step-model", help="a StepTimeModel JSON (pagoda bench routing --calibrate)")
    p.add_argument("--num-blocks", type=int, default=1025, help="KV blocks per replica (default: 16k tokens)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    step = StepTimeModel.load(args.step_model) if args.step_model else DEFAULT_STEP_MODEL
    workload = WorkloadConfig(num_tenants=args.num_requests, system_prompt_tokens=args.prompt_tokens - 64,
                              min_user_tokens=48, max_user_tokens=80, output_tokens=args.output_tokens,
                              num_requests=args.num_requests, seed=args.seed, zipf_s=0.0)
    slo = default_slo(step, args.prompt_tokens, args.slo_scale, args.itl_scale)
    started = time.perf_counter()
    rows = run_table([int(x) for x in args.devices.split(",")], [float(x) for x in args.rates_per_device.split(",")],
                     [float(x) for x in args.splits.split(",")], workload, slo,
                     TransferModel(args.block_bytes, args.transfer_mb_s, args.transfer_latency_s), step,
                     ReplicaConfig(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens))
    print(f"SLO: TTFT <= {slo.ttft_s:.2f} s, TPOT <= {slo.tpot_s:.3f} s, every inter-token gap <= "
          f"{slo.max_itl_s:.3f} s (x{args.slo_scale:g} / x{args.itl_scale:g} an unloaded "
          f"request's under {step.source or 'the given step model'}); {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} output tokens, {args.num_requests} requests per cell, transfer "
          f"{args.transfer_mb_s:g} MB/s of {args.block_bytes} B blocks; replicas of {args.num_blocks} blocks, "
          f"{args.max_num_seqs} sequences, {args.max_num_batched_tokens} tokens per step; "
          f"simulated in {time.perf_counter() - started:.0f} s")
    print(format_table(rows))
    return 0
