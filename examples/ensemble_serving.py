"""Ensemble serving: each query batch is broadcast to K model actors and their
answers gathered. hoplite-gpu (put the batch once, actors get it by id, answers
come back as objects) beside passing the batch through the Ray object store.
With --kill, one model actor is killed halfway; the ensemble answers with the
rest.

    python examples/ensemble_serving.py --models 4 --batch-mib 8 --queries 10
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import local_ray, ray, report

import hoplite_gpu as hg
import hoplite_gpu.ray as hray

DIM = 256


@ray.remote(num_cpus=0)
class Model:
    def __init__(self, seed: int) -> None:
        hray.join()
        self.w = np.random.default_rng(seed).standard_normal((DIM, 16)).astype(np.float32)

    def predict_hoplite(self, batch_id: hg.ObjectID, out_name: str) -> hg.ObjectID:
        batch = hg.get(batch_id, timeout=60)
        return hg.put(batch @ self.w, hg.ObjectID.from_name(out_name))

    def predict_ray(self, batch: np.ndarray) -> np.ndarray:
        return batch @ self.w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--batch-mib", type=int, default=8)
    p.add_argument("--queries", type=int, default=10)
    p.add_argument("--kill", action="store_true", help="kill one model actor halfway")
    args = p.parse_args()
    if min(args.models, args.batch_mib, args.queries) < 1:
        p.error("--models, --batch-mib and --queries must be at least 1")
    if args.kill and args.models < 2:
        p.error("--kill needs at least 2 models (one is killed, the others go on)")
    rows = (args.batch_mib << 20) // (DIM * 4)
    with local_ray():
        models = [Model.remote(s) for s in range(args.models)]
        ray.get([m.__ray_ready__.remote() for m in models])
        hop, base = [], []
        for q in range(args.queries + 1):  # query 0 warms up, untimed
            batch = np.random.default_rng(q).standard_normal((rows, DIM)).astype(np.float32)
            if args.kill and q == args.queries // 2:
                ray.kill(models.pop())
                print(f"query {q}: killed one model actor; {len(models)} answer")
            t0 = time.perf_counter()
            bid = hg.put(batch)
            outs = ray.get([m.predict_hoplite.remote(bid, f"ens/{q}/{i}")
                            for i, m in enumerate(models)], timeout=120)
            answer_h = np.mean([hg.get(o, timeout=60) for o in outs], axis=0)
            t_h = time.perf_counter() - t0
            hg.delete(bid)
            t0 = time.perf_counter()
            ref = ray.put(batch)
            answer_r = np.mean(ray.get([m.predict_ray.remote(ref) for m in models], timeout=120), axis=0)
            t_r = time.perf_counter() - t0
            assert np.allclose(answer_h, answer_r, rtol=1e-4, atol=1e-4), "the variants disagree"
            for o in outs:
                hg.delete(o)
            if q > 0:
                hop.append(t_h)
                base.append(t_r)
        to = (f"{args.models} models ({len(models)} after one was killed)"
              if len(models) != args.models else f"{args.models} models")
        report(f"ensemble query: {args.batch_mib} MiB batch to {to}, answers gathered",
               hop, base)


if __name__ == "__main__":
    main()
