#!/usr/bin/env python3
"""Checks a real Prometheus that scraped one attention_server under load
(tests/prometheus_test.sh runs both and the load, then this):

- what Prometheus stored equals what the server's /metrics says, and what
  the load tester counted: calls by code, their rate, batch sizes, queue
  depth and its limit, sessions open, cache bytes, sessions ended, rows;
- histogram_quantile over the latency buckets equals the same quantile
  computed here from the scraped buckets, and lies within the calls' range;
- the alert rules of deploy/prometheus/alerts.yml are loaded and healthy;
- every query of the Grafana dashboard (deploy/grafana) runs, and every
  one but the error panel's (no errors here) returns series; the error
  panel's ratios take the methods and codes of AttentionErrorRatioHigh's.

usage: prometheus_check.py PROMETHEUS_URL METRICS_URL LOAD.json SESSIONS.json
                           SESSION_INFO.json OPEN_SESSION_ROWS DASHBOARD.json
"""
import json
import re
import sys
import time
import urllib.parse
import urllib.request

prom, metrics_url, load_file, sessions_file, info_file, open_rows, dashboard_file = sys.argv[1:8]
load = json.load(open(load_file))
sessions = json.load(open(sessions_file))
info = json.load(open(info_file))
dashboard = json.load(open(dashboard_file))
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def query(expr):
    """An instant query's result: [(labels, value)], or raises on an error."""
    body = json.loads(get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]


def one(expr):
    result = query(expr)
    return result[0][1] if len(result) == 1 else None


def scraped():
    """The server's /metrics now: {sample name with labels: value}."""
    samples = {}
    for line in get(metrics_url).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def same(a, b, tolerance=1e-9):
    return a is not None and b is not None and abs(a - b) <= tolerance * max(1.0, abs(b))


# Prometheus has caught up with the server once a sample that only grew
# during the load is equal in both (the load is over; scrapes every second),
# and two more scrapes have come since (a rate over a window ending now
# sees the end of the load).
ok_calls = 'attention_requests_total{method="Attend",model="demo",code="OK"}'
deadline = time.time() + 30
caught_up = None
while time.time() < deadline:
    direct = scraped()
    if caught_up is None and same(one(ok_calls), direct.get(ok_calls)):
        caught_up = one(f'timestamp({ok_calls})')
    if caught_up is not None and one(f'timestamp({ok_calls})') >= caught_up + 2:
        break
    time.sleep(0.5)
direct = scraped()

# Calls: the load tester's OK calls of the demo model are the server's.
check(same(one(ok_calls), float(load["ok"])),
      f"{ok_calls} = {one(ok_calls)}: the load tester's {load['ok']} OK calls")
rate = one(f'sum(rate({ok_calls}[2m]))')
expected_rate = load["ok"] / 120.0  # rate() is per second over the window
check(rate is not None and 0.5 * expected_rate <= rate <= 1.5 * expected_rate,
      f"rate over 2m = {rate}/s: about {expected_rate:.2f}/s ({load['ok']} calls in the window)")
# By method and code: the session calls are there too (counted; their
# series began with the load tester's closes, so their first increase is
# not in a rate).
codes = {(m["method"], m["code"]) for m, _ in query(
    'sum by (method, code) (rate(attention_requests_total[2m])) > 0')}
check(("Attend", "OK") in codes, f"rates by method and code include Attend OK: {sorted(codes)}")
closes = one('sum(attention_requests_total{method="CloseSessions",code="OK"})')
check(same(closes, float(sessions["sessions"]["closed"])),
      f"CloseSessions OK = {closes}: the load tester's {sessions['sessions']['closed']} closes")

# Latency: histogram_quantile over the buckets equals the quantile computed
# here the way Prometheus defines it (linear within the bucket).
buckets = sorted(
    ((float(k.split('le="')[1].split('"')[0]), v) for k, v in direct.items()
     if k.startswith('attention_latency_seconds_bucket{stage="total",method="Attend"')),
    key=lambda b: b[0])


def quantile(q):
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return None


for q in (0.5, 0.99):
    got = one(f'histogram_quantile({q}, sum by (le) '
              f'(attention_latency_seconds_bucket{{stage="total",method="Attend"}}))')
    want = quantile(q)
    check(same(got, want, 1e-6), f"histogram_quantile({q}) of total latency = {got}: {want}")
p50 = one('histogram_quantile(0.5, sum by (le) (rate(attention_latency_seconds_bucket'
          '{stage="total",method="Attend"}[2m])))')
client_max_s = load["latency_us"]["max"] * 1e-6
check(p50 is not None and 0 < p50 <= client_max_s * 2.5,
      f"p50 of total latency over 2m = {p50} s: above 0, within a bucket of the "
      f"callers' slowest ({client_max_s} s)")

# Queue depth and its limit; batch sizes.
check(same(one("attention_queue_depth"), direct["attention_queue_depth"]),
      f"attention_queue_depth = {one('attention_queue_depth')}: the server's")
check(same(one("attention_queue_limit"), 256.0), "attention_queue_limit = --max_queue 256")
check(one("max_over_time(attention_queue_depth[2m])") is not None,
      "max_over_time(attention_queue_depth[2m]) has a value")
check(same(one("attention_batch_size_count"), direct["attention_batch_size_count"]),
      f"attention_batch_size_count = {one('attention_batch_size_count')}: the server's")
mean_batch = one("attention_batch_size_sum / attention_batch_size_count")
check(mean_batch is not None and mean_batch >= 1, f"mean batch size {mean_batch} >= 1")

# Sessions: the load tester's closed; one left open by the CLI.
s = sessions["sessions"]
check(same(one('attention_sessions_ended_total{reason="closed"}'), float(s["closed"])),
      f"sessions ended (closed) = the load tester's {s['closed']}")
check(same(one("attention_sessions_open"), 1.0), "attention_sessions_open = 1 (the CLI's)")
# Its blocks, and its bookkeeping: 1 KiB and its id (docs/sessions.md).
held = int(info["bytes"]) + 1024 + len(info["id"].encode())
check(same(one("attention_session_cache_bytes"), float(held)),
      f"attention_session_cache_bytes = GetSession's {info['bytes']} bytes + 1 KiB + its id")
rows = s["opened"] * s["prefill_rows"] + s["steps"] + int(open_rows)
check(same(one("attention_session_rows_appended_total"), float(rows)),
      f"attention_session_rows_appended_total = {rows}")
check(same(one("process_resident_memory_bytes"), direct["process_resident_memory_bytes"], 0.5),
      "process_resident_memory_bytes is the server's")

# The alert rules: loaded, evaluated without errors, nothing firing.
rules = json.loads(get(prom + "/api/v1/rules"))["data"]["groups"]
alerts = [r for g in rules for r in g["rules"] if r["type"] == "alerting"]
check(len(alerts) == 7 and all(r["health"] == "ok" for r in alerts),
      f"{len(alerts)} alert rules loaded, all healthy: "
      f"{[(r['name'], r['health'], r.get('lastError', '')) for r in alerts]}")
firing = [r["name"] for r in alerts if r["state"] != "inactive"]
check(firing == [], f"no alert pending or firing: {firing}")

# The dashboard's queries, with its variables set to everything.
for panel in dashboard["panels"]:
    for target in panel["targets"]:
        expr = (target["expr"].replace("$__rate_interval", "2m")
                .replace("$instance", ".*").replace("$job", ".*"))
        try:
            result = query(expr)
            optional = 'code=~"INTERNAL' in expr
            check(bool(result) or optional,
                  f"dashboard \"{panel['title']}\" {target['refId']}: {len(result)} series")
        except Exception as e:  # noqa: BLE001 - reported as a failure
            check(False, f"dashboard \"{panel['title']}\" {target['refId']}: {e}")

# The error panel shows what AttentionErrorRatioHigh watches: the same
# methods and codes on both sides of its ratio (the alert names the
# denominator's selector twice, once as its fallback for a replica without
# attention_requests_over_limit_total), and the share over a limit that the
# alert leaves out.
def request_selectors(expr, metric="attention_requests_total"):
    found = re.findall(metric + r"\{([^}]*)\}", expr)
    return [s for i, s in enumerate(found) if s not in found[:i]]


def matchers(selector, name):
    return re.findall(name + r'=~?"([^"]*)"', selector)


alert = next((r for r in alerts if r["name"] == "AttentionErrorRatioHigh"), None)
panel = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"]
                 if p["title"] == "Errors on the server's side")
if alert is None or not panel:
    check(False, "AttentionErrorRatioHigh and the error panel both exist")
else:
    for metric in ("attention_requests_total", "attention_requests_over_limit_total"):
        want = [(matchers(s, "method"), matchers(s, "code"))
                for s in request_selectors(alert["query"], metric)]
        got = [(matchers(s, "method"), matchers(s, "code"))
               for s in request_selectors(panel, metric)]
        check(len(want) == (2 if metric == "attention_requests_total" else 1) and got == want,
              f"the error panel's {metric} methods and codes {got} are the alert's {want}")

if failures:
    print(f"prometheus_check: {len(failures)} failed")
    sys.exit(1)
print("prometheus_check: PASS")
