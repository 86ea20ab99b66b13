"""What `diloco bench churn` counts, from the trainers' own files (metrics.jsonl and summary.json of every life),
and its section and figure.

- rounds ok / alone / failed: outer-step rows by `num_peers` (≥ 2 / 1 / 0), over every life of every group;
- catch-ups: rows with `loaded_state_from` (a group that downloaded the swarm's state);
- divergences: rounds (rows naming one `round`, `num_peers` ≥ 2) whose members hold different `outer_digest`s;
- hangs: a trainer that has joined and logs no row for 2 × (matchmaking + averaging timeout), one that has not
  joined within the start-up limit, one still running 90 s after SIGTERM or at the phase's end;
- orphans: helpers (DHT, averager, p2pd) of a `kill -9`ed trainer still running 15 s later;
- one final model: every group's last life ends `ok`, all with one `params_sha256`;
- throughput: tokens of inner steps that an outer step of the same life took in (work a kill threw away does not
  count) ÷ the seconds the lives trained (from their first round to their last, or to their kill or SIGTERM;
  start-ups and the wait for the others' start-up are not counted: "only live groups' time"); retained = soak ÷
  baseline;
- RSS: the long-lived groups' trainers with every descendant (DHT, averager, p2pd), every 10 s; the end against
  the sample nearest minute 5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from diloco.bench import section_head
from diloco.bench.churn_setup import ChurnSetup, Life, Slot


class Swarm(Protocol):
    """What a phase of the soak kept (``diloco.bench.churn.Swarm``)."""

    slots: list[Slot]
    hangs: list[dict[str, Any]]
    orphans: list[dict[str, Any]]
    rss: dict[int, list[Any]]

__all__ = ["analyse", "markdown", "plot", "rows_of"]

RETAINED_TARGET = 0.97
RSS_GROWTH_TARGET = 0.10


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics rows of a life (a killed writer may leave half a line: it is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def life_figures(life: Life, tokens_per_step: int) -> dict[str, Any]:
    """A life's rounds and catch-ups, and its share of the throughput: counted from its first round (before it,
    a group waits for the others' start-up in either phase) to its last round, or to its kill or SIGTERM (the
    steps it trained after its last round are thrown away: time without tokens)."""
    rows = rows_of(life.run_dir)
    steps = [r for r in rows if "loss" in r]
    outers = [r for r in rows if "num_peers" in r]
    committed, live_s = 0, 0.0
    if outers:
        first, last = outers[0], outers[-1]
        committed = sum(first["step"] < r["step"] <= last["step"] for r in steps) * tokens_per_step
        cut = life.end in ("kill-9", "sigterm") and life.ended_at is not None
        live_s = max(0.0, (life.ended_at if cut else last["time"]) - first["time"])
    return {
        **life.to_dict(),
        "inner_steps": len(steps),
        "committed_tokens": committed,
        "live_s": round(live_s, 2),
        "rounds": {"ok": sum(r["num_peers"] >= 2 for r in outers), "alone": sum(r["num_peers"] == 1 for r in outers),
                   "failed": sum(r["num_peers"] == 0 for r in outers),  # of which sat out: behind the others
                   "sat_out": sum(bool(r.get("sat_out")) for r in outers)},  # fmt: skip
        "catch_ups": sum("loaded_state_from" in r for r in rows),
    }


DIVERGENCE_FIELDS = ("life_dir", "step", "outer_step", "round_step", "num_peers", "loaded_state_from", "weight",
                     "time")  # fmt: skip


def divergences(lives: list[Life]) -> tuple[int, int, list[dict[str, Any]]]:
    """(rounds named, rounds whose members' outer digests differ, those rounds with each member's row: what a
    reader needs to tell a real divergence from a row written after a state load)."""
    members: dict[str, dict[int, dict[str, Any]]] = {}
    for life in lives:
        for row in rows_of(life.run_dir):
            if row.get("num_peers", 0) >= 2 and row.get("round"):
                members.setdefault(row["round"], {})[life.group] = {"life_dir": life.run_dir.name, **row}
    bad = [{"round": name, "digests": {str(g): r["outer_digest"] for g, r in seen.items()},
            "rows": {str(g): {k: v for k, v in r.items() if k in DIVERGENCE_FIELDS} for g, r in seen.items()}}
           for name, seen in members.items() if len({r["outer_digest"] for r in seen.values()}) > 1]  # fmt: skip
    return len(members), len(bad), bad


def final_models(swarm: Swarm) -> dict[str, Any]:
    finals = []
    for slot in swarm.slots:
        path = slot.lives[-1].run_dir / "summary.json"
        done = json.loads(path.read_text()) if path.exists() else {}
        finals.append({"group": slot.group, "status": done.get("status", "no summary"),
                       "outer_steps": done.get("outer_steps"), "params_sha256": done.get("params_sha256")})  # fmt: skip
    one = all(f["status"] == "ok" for f in finals) and len({f["params_sha256"] for f in finals}) == 1
    return {"groups": finals, "one_final_model": one}


def phase(swarm: Swarm, tokens_per_step: int) -> dict[str, Any]:
    lives = [life for slot in swarm.slots for life in slot.lives]
    figures = [life_figures(life, tokens_per_step) for life in lives]
    named, diverged, which = divergences(lives)
    committed = sum(f["committed_tokens"] for f in figures)
    live_s = sum(f["live_s"] for f in figures)
    rounds = {kind: sum(f["rounds"][kind] for f in figures) for kind in ("ok", "alone", "failed", "sat_out")}
    return {
        "lives": figures,
        "rounds": rounds,
        "rounds_named": named,
        "catch_ups": sum(f["catch_ups"] for f in figures),
        "divergences": diverged,
        "divergent_rounds": which,
        "hangs": swarm.hangs,
        "orphans": swarm.orphans,
        "committed_tokens": committed,
        "live_s": round(live_s, 1),
        "tokens_per_s": committed / live_s if live_s else None,
        **final_models(swarm),
        "rss_mb": {str(g): samples for g, samples in swarm.rss.items()},
    }


def by_end(lives: list[dict[str, Any]], tokens_per_step: int, baseline_tokens_per_s: float | None) -> dict[str, Any]:
    """The soak's throughput split by how each life ended (exit: ran to the end; kill-9; sigterm), each against the
    baseline: where churn costs throughput. A killed or stopped life's steps after its last round are never
    averaged (the swarm moved on), yet its time up to its end counts."""
    split: dict[str, Any] = {}
    for life in lives:
        end = life["end"] or "running"
        kind = split.setdefault(end, {"lives": 0, "live_s": 0.0, "committed_tokens": 0, "uncounted_steps": 0})
        kind["lives"] += 1
        kind["live_s"] += life["live_s"]
        kind["committed_tokens"] += life["committed_tokens"]
        kind["uncounted_steps"] += life["inner_steps"] - life["committed_tokens"] // tokens_per_step
    for kind in split.values():
        kind["live_s"] = round(kind["live_s"], 1)
        kind["tokens_per_s"] = kind["committed_tokens"] / kind["live_s"] if kind["live_s"] else None
        kind["retained"] = (kind["tokens_per_s"] / baseline_tokens_per_s
                            if kind["tokens_per_s"] and baseline_tokens_per_s else None)  # fmt: skip
    return split


def rss_growth(samples: list[list[float]] | list[tuple[float, float]], reference_s: float) -> dict[str, Any] | None:
    """The last sample against the one nearest `reference_s` into the soak."""
    if len(samples) < 2:
        return None
    t_ref, ref = min(samples, key=lambda s: abs(s[0] - reference_s))
    t_end, end = samples[-1]
    return {"reference_s": t_ref, "reference_mb": ref, "end_s": t_end, "end_mb": end, "growth": end / ref - 1}


def analyse(setup: ChurnSetup, baseline: Swarm, soak: Swarm, events: list[dict[str, Any]], rounds: int,
            round_s: float) -> dict[str, Any]:  # fmt: skip
    import dataclasses

    base, churn = phase(baseline, setup.tokens_per_step), phase(soak, setup.tokens_per_step)
    retained = churn["tokens_per_s"] / base["tokens_per_s"] if churn["tokens_per_s"] and base["tokens_per_s"] else None
    rss = {g: rss_growth(samples, setup.rss_reference_s) for g, samples in churn["rss_mb"].items()}
    actions: dict[str, int] = {}
    for event in events:
        actions[event["action"]] = actions.get(event["action"], 0) + 1
    verdicts = {
        "events": len(events) >= setup.min_events,
        "divergences": base["divergences"] == 0 and churn["divergences"] == 0,
        "hangs": not base["hangs"] and not churn["hangs"],
        "one_final_model": base["one_final_model"] and churn["one_final_model"],
        "throughput_retained": retained is not None and retained >= RETAINED_TARGET,
        "rss": all(r is not None and r["growth"] <= RSS_GROWTH_TARGET for r in rss.values()),
    }
    return {
        "setup": dataclasses.asdict(setup),
        "baseline_round_s": round(round_s, 2),
        "soak_rounds": rounds,
        "soak_t0": soak.t0,
        "soak_s": round(max((life["ended_at"] or 0) for life in churn["lives"]) - soak.t0, 1),
        "events": events,
        "actions": actions,
        "baseline": base,
        "soak": churn,
        "throughput_retained": retained,
        "retained_by_end": by_end(churn["lives"], setup.tokens_per_step, base["tokens_per_s"]),
        "rss_growth": rss,
        "targets": {"throughput_retained": RETAINED_TARGET, "rss_growth": RSS_GROWTH_TARGET,
                    "events": setup.min_events},  # fmt: skip
        "verdicts": verdicts,
    }


# ---------------------------------------------------------------- the section and the figure


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def markdown(result: dict[str, Any]) -> str:
    s, base, soak, v = result["setup"], result["baseline"], result["soak"], result["verdicts"]
    shapes = ", ".join(f"{r} rank{'s' if r > 1 else ''}" for r in s["ranks"])
    actions = ", ".join(f"{n} {a}" for a, n in sorted(result["actions"].items()))
    retained = result["throughput_retained"]
    lines = [
        *section_head(result),
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
        f"- swarm: {len(s['ranks'])} worker groups ({shapes}) on loopback, one `diloco dht`, each held by a cgroup "
        f"to {', '.join(f'{c:g}' for c in s['cores'])} of a core (everything it runs); byte llama (1.1M "
        "parameters) on tinyshakespeare, "
        f"{s['seq_length']}×{s['batch']} tokens per inner step, H = {s['local_steps']}, pace "
        f"{s.get('pace') or 'tokens (the default)'}, matchmaking "
        f"{_seconds(s.get('matchmaking_s'))}, averaging timeout {_seconds(s.get('averaging_timeout_s'))}, a "
        "checkpoint every round",
        f"- baseline: {s['baseline_rounds']} rounds, no churn ({result['baseline_round_s']:.1f} s a round); soak: "
        f"{result['soak_rounds']} rounds, {result['soak_s'] / 60:.1f} min; groups 0–{s['long_lived'] - 1} "
        f"live throughout, the others churned every {s['gap_s'][0]:g}–{s['gap_s'][1]:g} s (seeded)",
        f"- events: {len(result['events'])} ({actions}); target ≥ {s['min_events']}: {_met(v['events'])}",
        "",
        "| | rounds ok / alone / failed | catch-ups | divergences | hangs | orphaned helpers | one final model | "
        "committed tokens/s per live group |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, p in (("baseline", base), ("soak", soak)):
        r = p["rounds"]
        rate = f"{p['tokens_per_s']:.0f}" if p["tokens_per_s"] else "–"
        lines.append(f"| {name} | {r['ok']} / {r['alone']} / {r['failed']} | {p['catch_ups']} | {p['divergences']} "
                     f"of {p['rounds_named']} rounds | {len(p['hangs'])} | {len(p['orphans'])} | "
                     f"{p['one_final_model']} | {rate} |")  # fmt: skip
    lines += [
        "",
        f"- 0 divergences: {_met(v['divergences'])}; 0 hangs: {_met(v['hangs'])}; one final model: "
        f"{_met(v['one_final_model'])}",
        f"- throughput retained (soak ÷ baseline, committed tokens per live group-second): "
        f"{'–' if retained is None else f'{retained:.3f}'}; target ≥ {result['targets']['throughput_retained']}: "
        f"{_met(v['throughput_retained'])}",
    ]
    words = {"exit": "ran to the end", "kill-9": "were killed (kill -9)", "sigterm": "were stopped (SIGTERM)"}
    for end, kind in result.get("retained_by_end", {}).items():  # (absent from results before 2026-11-25)
        rate = "–" if kind["tokens_per_s"] is None else f"{kind['tokens_per_s']:.0f} tokens/s"
        share = "" if kind["retained"] is None else f" ({kind['retained']:.3f} of the baseline)"
        lines.append(f"  - lives that {words.get(end, end)}: {kind['lives']}, {kind['live_s']:.0f} group-s, "
                     f"{rate}{share}; {kind['uncounted_steps']} steps outside their counted rounds")  # fmt: skip
    for g, r in result["rss_growth"].items():
        if r is None:
            lines.append(f"- RSS of group {g}: too few samples")
            continue
        lines.append(f"- RSS of group {g} (trainer, DHT, averager, p2pd): {r['reference_mb']:.0f} MiB at "
                     f"{r['reference_s'] / 60:.1f} min, {r['end_mb']:.0f} MiB at {r['end_s'] / 60:.1f} min "
                     f"({r['growth'] * 100:+.1f}%)")  # fmt: skip
    lines.append(f"- RSS within {result['targets']['rss_growth'] * 100:.0f}% of minute 5 at the end: {_met(v['rss'])}")
    for p in (base, soak):
        for hang in p["hangs"]:
            lines.append(f"- hang: group {hang['group']} (life {hang['life']}): {hang['what']}")
        for orphan in p["orphans"]:
            lines.append(f"- orphaned after kill -9: group {orphan['group']} (life {orphan['life']}): "
                         f"{', '.join(orphan['processes'])}")  # fmt: skip
    if "plot" in result:
        lines += ["", f"![churn soak]({result['plot']})"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> Path:
    """Each group's lives as bars over the soak with the events marked, and the long-lived groups' RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    soak, t0 = result["soak"], result.get("soak_t0", 0.0)
    fig, (lives, rss) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for life in soak["lives"]:
        start = (life["started_at"] - t0) / 60
        end = ((life["ended_at"] or life["started_at"]) - t0) / 60
        color = {"kill-9": "tab:red", "sigterm": "tab:orange"}.get(life["end"] or "", "tab:green")
        lives.barh(life["group"], end - start, left=start, color=color, edgecolor="black", linewidth=0.3)
    lives.set_ylabel("group (red: kill -9, orange: SIGTERM)")
    lives.invert_yaxis()
    for g, samples in soak["rss_mb"].items():
        if samples:
            rss.plot([t / 60 for t, _ in samples], [m for _, m in samples], label=f"group {g}")
    rss.set_xlabel("minutes into the soak")
    rss.set_ylabel("RSS, MiB")
    rss.legend()
    fig.suptitle(f"diloco bench churn{' (quick)' if result['quick'] else ''}: {result['date']}")
    fig.tight_layout()
    path = out / f"churn{'-quick' if result['quick'] else ''}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _seconds(value: float | None) -> str:
    """A timing flag of the soak: seconds, or auto (the default: the flag was not passed)."""
    return "auto (the default)" if value is None else f"{value:g} s"
