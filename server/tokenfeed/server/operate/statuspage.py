"""The status page's HTML, rendered from a status snapshot (snapshot.py): one document with
inline CSS and no scripts or external assets, so it renders anywhere a browser can reach the port
(a `kubectl port-forward` included). It reloads itself every few seconds with a meta refresh (no
script needed).
"""

from __future__ import annotations

import html
import time

# Often enough to follow a build or a run, rarely enough that an open tab costs nothing: the
# throughput it shows is sampled every snapshot.SAMPLE_SECONDS anyway.
REFRESH_SECONDS = 5


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, h, m, s = s // 86400, s // 3600 % 24, s // 60 % 60, s % 60
    if d:
        return f"{d} d {h} h {m:02d} min"
    if h:
        return f"{h} h {m:02d} min {s:02d} s"
    return f"{m} min {s:02d} s" if m else f"{s} s"


def render(s: dict) -> str:
    """The page of snapshot `s` (snapshot.status)."""
    e = html.escape
    srv = s["server"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
        f"<title>tokenfeed {e(srv['node'])}</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;"
        "padding:.25em .6em;text-align:left}th{background:#f3f3f3}.ready{color:#070}"
        ".failed{color:#b00}.indexing{color:#a60}.bar{background:#eee;width:12em;height:.8em}"
        ".bar div{background:#47a;height:100%}</style></head><body>",
        f"<h1>tokenfeed</h1><table><tr><th>host</th><td id='host'>{e(srv['host'])}</td></tr>"
        f"<tr><th>node</th><td id='node'>{e(srv['node'])}</td></tr>"
        f"<tr><th>version</th><td id='version'>{e(srv['version'])}</td></tr>"
        f"<tr><th>uptime</th><td id='uptime' data-seconds='{int(srv['uptime_seconds'])}'>"
        f"{_duration(srv['uptime_seconds'])} (since {_when(srv['started'])})</td></tr></table>"
        f"<p>as of {_when(s['time'])}, reloaded every {REFRESH_SECONDS} s; "
        "<a href='/metrics'>/metrics</a> (Prometheus), "
        "<a href='/status.json'>/status.json</a></p><h2>Jobs</h2>",
    ]
    for j in s["jobs"]:
        built = j["chunks_built"] / j["chunks"] if j["chunks"] else 0.0
        parts.append(
            f"<h3 id='job-{e(j['name'])}'>{e(j['name'])} "
            f"<span class='{e(j['state'])}'>{e(j['state'])}</span></h3><table>"
            f"<tr><th>build progress</th><td><div class='bar'><div style='width:"
            f"{100 * built:.0f}%'></div></div>{j['chunks_built']} / {j['chunks']} chunks</td></tr>"
            f"<tr><th>furthest step</th><td>{j['furthest_step']}</td></tr>"
            f"<tr><th>prefetch lead</th><td>{j['lead_steps']} steps, {j['lead_seconds']} s</td>"
            f"</tr><tr><th>step rate</th><td>{j['step_rate']} steps/s</td></tr>"
            f"<tr><th>throughput</th><td>{j['tokens_per_second']:,.0f} tokens/s (last minute)"
            f"</td></tr><tr><th>fingerprint</th><td><code>{e(j['fingerprint'])}</code></td></tr>"
        )
        if j["error"]:
            parts.append(f"<tr><th>error</th><td class='failed'>{e(j['error'])}</td></tr>")
        parts.append("</table>")
        parts.append(_render_plan(j["plan"]))
        if j["ranks"]:
            parts.append(
                "<table><tr><th>rank</th><th>world size</th><th>latest step</th>"
                "<th>last request</th></tr>"
            )
            parts += [
                f"<tr><td>{r['rank']}</td><td>{r['world_size']}</td><td>{r['step']}</td>"
                f"<td>{_when(r['seen'])}</td></tr>"
                for r in j["ranks"]
            ]
            parts.append("</table>")
    c = s["cache"]
    if c is not None:
        parts.append(
            f"<h2>Disk cache</h2><table><tr><th>use</th><td>{_mib(c['used_bytes'])} of "
            f"{_mib(c['budget_bytes'])}</td></tr><tr><th>evictions</th><td>{c['evictions']}"
            "</td></tr>"
        )
        parts += [
            f"<tr><th>{e(k)}</th><td>{v['entries']} entries, {_mib(v['bytes'])}</td></tr>"
            for k, v in sorted(c["kinds"].items())
        ]
        parts.append("</table>")
    parts.append("<h2>Recent warnings and errors</h2>")
    if s["events"]:
        parts.append("<table><tr><th>time</th><th>level</th><th>message</th></tr>")
        parts += [
            f"<tr><td>{_when(ev['time'])}</td><td>{e(ev['level'])}</td>"
            f"<td>{e(ev['message'])}</td></tr>"
            for ev in reversed(s["events"])
        ]
        parts.append("</table>")
    else:
        parts.append("<p>none</p>")
    parts.append("</body></html>")
    return "".join(parts)


def _render_plan(p: dict) -> str:
    e = html.escape
    out = [
        f"<table id='plan'><tr><th>data plan</th><td>version {p['version']}, frozen through "
        f"step {p['horizon']}, phase {p['phase']} in force; log {e(p['log'])}</td></tr></table>",
        "<table><tr><th>from step</th><th>batch</th><th>seq_len</th><th>weights</th>"
        "<th>fingerprint</th></tr>",
    ]
    for k, ph in enumerate(p["phases"]):
        mark = " class='ready'" if k == p["phase"] else ""
        weights = ", ".join(f"{e(n)} {e(w)}" for n, w in ph["weights"].items())
        out.append(
            f"<tr{mark}><td>{ph['start_step']}</td><td>{ph['global_batch_size']}</td>"
            f"<td>{ph['seq_len']}</td><td>{weights}</td>"
            f"<td><code>{e(ph['fingerprint'][:12])}</code></td></tr>"
        )
    out.append(
        f"</table><table><tr><th>dataset</th><th>rows before step "
        f"{p['consumed_before_step']}</th><th>row tokens</th></tr>"
    )
    out += [
        f"<tr><td>{e(c['dataset'])}</td><td>{c['rows']:,}</td><td>{c['tokens']:,}</td></tr>"
        for c in p["consumed"]
    ]
    out.append("</table>")
    return "".join(out)
