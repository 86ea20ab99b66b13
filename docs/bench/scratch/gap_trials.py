"""Scratch trials for issue 15's 4-group gap (docs/benchmarks.md, 2026-11-26 05:13-05:46 UTC): not the product,
not a bench command. A copy of `diloco.bench.convergence.run_arm` (the `defaults` workload) with hooks, each named by
a key of an arm's `extra`:

- early (e, until, lr): rounds every e inner steps up to step `until` (outer lr `lr` there), then every H
- adam_avg: every group's AdamW moments set to their mean across the groups after each outer step
- strided: group g reads blocks g, g + k, g + 2k, ... of the corpus instead of its contiguous quarter
- steps S: the arm's inner steps per group in place of the workload's
- norm_match a / tensor_match a / row_match a: the averaged pseudo-gradient scaled by (mean over groups of the
  pseudo-gradient's norm ÷ the mean's norm) ** a, over the whole model / per tensor / per row (RMS over groups;
  `cap` bounds it), on top of the outer lr and its warm-up
- nadam K (with seq: true, the variance from two consecutive steps' gradients instead): the first version of the
  galaxy's second moment (`NoiseAdam` below; the trainer's is diloco/galaxy_moment.py), AdamW's second moment
  corrected to a K times larger batch from the variance of two half-batch gradients (2026-11-26 09:25-09:50 UTC)

Run from the repository root: PYTHONPATH=. python docs/bench/scratch/gap_trials.py OUT.jsonl ARMS_JSON [STUDY], each
arm [k, H, outer lr (0: DDP at k·B), momentum, outer-lr warm-up, seed, extra]; STUDY: the bench's workload
(defaults, or map). Two arms at a time."""
import functools, json, logging, math, sys, threading, time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path
import torch
from transformers import get_cosine_schedule_with_warmup
import diloco.bench.convergence as C
from diloco.pace import FixedSteps


class EarlyPace(FixedSteps):
    """Rounds every `e` inner steps up to step `until`, then every H."""
    def __init__(self, h, final, e, until):
        super().__init__(h, final)
        self.e, self.until = e, until
    def due(self, step, outer_step, tokens):
        return (step <= self.until and step % self.e == 0) or super().due(step, outer_step, tokens)
    def round_index(self, step, outer_step):
        n = sum(1 for s in range(1, step + 1) if self.due(s, 0, 0))
        return n if self.due(step, 0, 0) else n + 1


class NoiseAdam:
    """AdamW whose second moment is corrected towards what a K-times larger batch would see: two half-batch
    gradients g1, g2 give an unbiased estimate n = ((g1 - g2) / 2)^2 of the gradient's variance per coordinate, and
    v tracks EMA(g^2) - (1 - 1/K) EMA(n), floored at EMA(g^2) / K. The lr comes from `opt` (its schedule)."""
    def __init__(self, params, K, opt, seq=False):
        self.params, self.K, self.opt, self.t = params, float(K), opt, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.sq = [torch.zeros_like(p) for p in params]
        self.n = [torch.zeros_like(p) for p in params]
        self.seq, self.prev = seq, None

    def step_seq(self, model, batch):
        """One gradient per step; the variance estimate from two consecutive steps' gradients, ((g_t - g_t-1)^2 / 2)."""
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), C.GRAD_CLIP)
        g = [p.grad.detach().clone() for p in self.params]
        for p in self.params:
            p.grad = None
        n = [torch.zeros_like(x) for x in g] if self.prev is None else [(a - b) ** 2 / 2 for a, b in zip(g, self.prev)]
        self.prev = [x.clone() for x in g]
        self.apply(g, n, 1.0)
        return loss.detach()

    def apply(self, g, n, c):
        group = self.opt.param_groups[0]
        lr, (b1, b2), wd, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
        self.t += 1
        with torch.no_grad():
            for p, gi, ni, m, sq, nn in zip(self.params, g, n, self.m, self.sq, self.n):
                gi.mul_(c); ni.mul_(c * c)
                m.mul_(b1).add_(gi, alpha=1 - b1)
                sq.mul_(b2).addcmul_(gi, gi, value=1 - b2)
                nn.mul_(b2).add_(ni, alpha=1 - b2)
                v = torch.maximum(sq - (1 - 1 / self.K) * nn, sq / self.K) / (1 - b2 ** self.t)
                p.mul_(1 - lr * wd)
                p.addcdiv_(m / (1 - b1 ** self.t), v.sqrt().add_(eps), value=-lr)

    def step(self, model, batch):
        if self.seq:
            return self.step_seq(model, batch)
        half = batch.shape[0] // 2
        grads, losses = [], []
        for b in (batch[:half], batch[half:]):
            loss = model(input_ids=b, labels=b, use_cache=False).loss
            loss.backward()
            grads.append([p.grad.detach().clone() for p in self.params])
            losses.append(loss.detach())
            for p in self.params:
                p.grad = None
        g = [(a + b) / 2 for a, b in zip(*grads)]
        n = [((a - b) / 2) ** 2 for a, b in zip(*grads)]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in g]))
        self.apply(g, n, min(1.0, C.GRAD_CLIP / (float(norm) + 1e-6)))
        return (losses[0] + losses[1]) / 2


def run_arm(spec, extra, w, corpus):
    seed = w.seed if spec.seed is None else spec.seed
    lr = w.lr if spec.lr is None else spec.lr
    warmup = w.warmup_steps if spec.warmup_steps is None else spec.warmup_steps
    swarm = C.MemorySwarm(spec.groups)
    models = [C.load_model(w.model, seed) for _ in range(spec.groups)]
    opts = []
    deltas = [None] * spec.groups
    scale = [1.0] * spec.groups
    ratios = []
    vec = [None] * spec.groups
    curve = []
    barrier = threading.Barrier(spec.groups) if spec.groups > 1 else None
    early = extra.get("early")  # (e, until, early_lr)
    n_early = 0 if not early else early[1] // early[0]

    def group(g):
        model = models[g]
        data = C.BlockBatches(corpus.train, C.Shard(g, spec.groups), spec.batch, seed)
        if extra.get("strided"):
            data.blocks = corpus.train[g::spec.groups][: len(corpus.train) // spec.groups]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=C.ADAMW_BETAS, weight_decay=C.WEIGHT_DECAY)
        opts.append(opt)
        schedule = get_cosine_schedule_with_warmup(opt, warmup, spec.steps)
        outer = None
        if spec.outer is not None:
            outer_lr, momentum = spec.outer
            pace = EarlyPace(spec.h, spec.steps, early[0], early[1]) if early else None
            outer = C.DiLoCo([p.data for p in model.parameters()], swarm.member(f"g{g}"), C.solo_group(),
                             world_rank=g, local_steps=spec.h, outer_lr=outer_lr, outer_momentum=momentum,
                             outer_warmup=spec.outer_warmup, final_step=spec.steps, pace=pace)
            if early:
                base = outer.params
                def lr_at(s, base=base):
                    if s < n_early:
                        return early[2]
                    r = s - n_early
                    return base.lr * min(1.0, (r + 1) / base.warmup) if base.warmup else base.lr
                base.lr_at = lr_at
            if "norm_match" in extra:
                base = outer.params
                def lr_at(s, base=base, g=g):
                    w = min(1.0, (s + 1) / base.warmup) if base.warmup else 1.0
                    return base.lr * w * scale[g]
                base.lr_at = lr_at
            if "tensor_match" in extra or "row_match" in extra:
                base = outer.params
                orig = base.step
                def step_(pg, fragment=None, mix=0.0, orig=orig, g=g):
                    return orig(pg * vec[g], fragment, mix)
                base.step = step_
            if "lr_sched" in extra:
                base = outer.params
                sched = extra["lr_sched"]
                base.lr_at = lambda s: sched[min(s, len(sched) - 1)]
        nadam = NoiseAdam(list(model.parameters()), extra["nadam"], opt, extra.get("seq", False)) if "nadam" in extra else None
        for step in range(1, spec.steps + 1):
            batch = data.next_batch()
            if nadam is not None:
                loss = nadam.step(model, batch)
                schedule.step()
            else:
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), C.GRAD_CLIP)
                opt.step(); schedule.step(); opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"loss {loss.item()}")
            if "norm_match" in extra and step % spec.h == 0:
                d = outer.params.pseudo_gradient().clone()
                deltas[g] = d
                barrier.wait()
                mean = torch.stack(deltas).mean(0)
                ratio = float(torch.stack([x.norm() for x in deltas]).mean() / mean.norm())
                ratios.append(ratio) if g == 0 else None
                scale[g] = min(ratio ** extra["norm_match"], extra.get("cap", 10.0))
                barrier.wait()
            if "tensor_match" in extra and step % spec.h == 0:
                deltas[g] = outer.params.pseudo_gradient().clone()
                barrier.wait()
                numels = [p.numel() for p in model.parameters()]
                parts = [torch.stack(x) for x in zip(*[d.split(numels) for d in deltas])]  # per tensor: (k, n)
                r = torch.tensor([float(pp.norm(dim=1).mean() / pp.mean(0).norm().clamp_min(1e-12)) for pp in parts])
                r = r.clamp(max=extra.get("cap", 10.0)) ** extra["tensor_match"]
                vec[g] = torch.repeat_interleave(r, torch.tensor(numels))
                if g == 0:
                    ratios.append(float(r.mean()))
                barrier.wait()
            if "row_match" in extra and step % spec.h == 0:
                deltas[g] = outer.params.pseudo_gradient().clone()
                barrier.wait()
                shapes = [p.shape for p in model.parameters()]
                numels = [p.numel() for p in model.parameters()]
                out = []
                for sh, pp in zip(shapes, zip(*[d.split(numels) for d in deltas])):
                    x = torch.stack(pp)  # (k, n)
                    rows = x.reshape(x.shape[0], sh[0], -1) if (len(sh) > 1 or extra.get("row_1d")) else x.reshape(x.shape[0], 1, -1)
                    rms = rows.pow(2).sum(-1).mean(0).sqrt()
                    mn = rows.mean(0).norm(dim=-1).clamp_min(1e-12)
                    r = (rms / mn).clamp(max=extra.get("cap", 10.0))
                    out.append(r.repeat_interleave(rows.shape[-1]))
                vec[g] = torch.cat(out)
                if g == 0:
                    ratios.append(float(vec[g].mean()))
                barrier.wait()
            synced = outer is not None and outer.after_inner_step(step) is not None
            if g == 0 and (synced or outer is None) and step % extra.get("every", 25) == 0:
                curve.append((step, C.eval_loss(model, corpus.held_out)))
            if synced and extra.get("adam_avg") and barrier is not None:
                barrier.wait()
                if g == 0:
                    with torch.no_grad():
                        for ps in zip(*[list(m.parameters()) for m in models]):
                            states = [o.state[p] for o, p in zip(opts, ps)]
                            for key in ("exp_avg", "exp_avg_sq"):
                                mean = torch.stack([s[key] for s in states]).mean(0)
                                for s in states:
                                    s[key].copy_(mean)
                barrier.wait()

    threads = [threading.Thread(target=swarm.guard(functools.partial(group, g))) for g in range(spec.groups)]
    t0 = time.perf_counter()
    for t in threads: t.start()
    for t in threads: t.join()
    if swarm.failed:
        raise RuntimeError(str(swarm.failed[0]))
    final = C.eval_loss(models[0], corpus.held_out)
    identical = all(torch.equal(p, q) for m in models[1:] for p, q in zip(models[0].parameters(), m.parameters()))
    return asdict(spec) | {"extra": extra, "seed": seed, "final_eval_loss": final, "groups_identical": identical, "curve": curve, "ratios": ratios,
                           "rounds": swarm.wire_bytes, "wall_s": time.perf_counter() - t0}


_W = {}
def _start(w, data):
    torch.set_num_threads(1)
    logging.getLogger("diloco").setLevel(logging.ERROR)
    _W.update(w=w, corpus=C.load_corpus(w, data))
def _run(item):
    return run_arm(item[0], item[1], _W["w"], _W["corpus"])


def main():
    from diloco.bench.models import model_folder
    out = Path(sys.argv[1])
    w = C.workload(False, sys.argv[3] if len(sys.argv) > 3 else "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    items = []
    for spec in json.loads(sys.argv[2]):
        k, h, lr, mom, wu, seed, extra = spec
        s = C.diloco_arm(k, w, h, (lr, mom, wu), seed) if lr else C.baselines(k, w, seed)[1]
        if "steps" in extra:  # S: inner steps per group (the workload's otherwise)
            s = replace(s, steps=extra["steps"])
        items.append((s, extra))
    data = Path(__file__).resolve().parents[3] / "diloco" / "corpus" / "tinyshakespeare.txt"
    ctx = get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx, initializer=_start, initargs=(w, data)) as pool, open(out, "a") as f:
        for fut in as_completed([pool.submit(_run, it) for it in items]):
            r = fut.result()
            f.write(json.dumps(r) + "\n"); f.flush()
            print(r["k"], r["seed"], r.get("outer"), r.get("outer_warmup"), json.dumps(r["extra"]), round(r["final_eval_loss"], 4), [round(l, 3) for _, l in r["curve"]],
                  r["groups_identical"], round(r["wall_s"]), [round(x, 2) for x in r["ratios"]], flush=True)

if __name__ == "__main__":
    main()
