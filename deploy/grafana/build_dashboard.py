"""Writes deploy/grafana/sluice-dashboard.json, the Grafana dashboard over the engines' and the
gateways' metrics (docs/metrics.md). Edit this file, then run it; tests/unit/test_monitoring_config.py
fails when the JSON is not what this script writes.

    python deploy/grafana/build_dashboard.py

Engine metrics are ``sluice:*`` (selected by the ``model`` and ``engine_id`` variables), gateway
metrics ``sluice_gateway:*``: the names tell the two apart, so the dashboard does not depend on
scrape job names.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("sluice-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
ENGINE = 'engine_id!="", model=~"$model", engine_id=~"$engine_id"'
GATEWAY = ""  # the sluice_gateway: names are the gateways' alone
RATE = "[$__rate_interval]"
# HAProxy's exporter (compose's `lb`): the backend of gateway replicas and the clients' frontend.
LB = 'proxy="gateways"'
LB_FRONTEND = 'proxy="api"'


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, selector: str, qs=(0.5, 0.9, 0.99), prefix: str = "") -> list[dict]:
    return [
        q(f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket{{{selector}}}{RATE})))",
          f"{prefix}p{int(p * 100)}")
        for p in qs
    ]


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self.newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def panel(self, title: str, targets: list[dict], unit: str = "short", w: int = 8, h: int = 8,
              description: str = "", kind: str = "timeseries", stack: bool = False,
              max_value: float | None = None) -> None:
        if self.x + w > 24:
            self.newline()
        defaults: dict = {"unit": unit, "min": 0}
        if max_value is not None:
            defaults["max"] = max_value
        if kind == "timeseries":
            defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        panel = {
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {},
            "targets": [{**t, "datasource": DS, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def build() -> dict:
    L = Layout()

    L.row("Traffic")
    L.panel("Token throughput (engines)", [
        q(f"sum(rate(sluice:generation_tokens_total{{{ENGINE}}}{RATE}))", "generated tokens/s"),
        q(f"sum(rate(sluice:prompt_tokens_total{{{ENGINE}}}{RATE}))", "prefilled tokens/s"),
    ], unit="short", description="Tokens generated and prompt tokens prefilled per second, all selected engines.")
    L.panel("Finished requests/s by reason (gateways)", [
        q(f"sum by (finished_reason) (rate(sluice_gateway:request_success_total{{{GATEWAY}}}{RATE}))", "{{finished_reason}}"),
    ], unit="reqps", stack=True, description="Completions sent to clients, by finish reason.")
    L.panel("HTTP requests/s by status (gateways)", [
        q(f"sum by (status) (rate(sluice_gateway:http_requests_total{{{GATEWAY}}}{RATE}))", "{{status}}"),
    ], unit="reqps", stack=True, description="Every answered HTTP request, by status code.")
    L.panel("Errors/s by HTTP code (gateways)", [
        q(f'sum by (status) (rate(sluice_gateway:http_requests_total{{status=~"4..|5.."}}{RATE}))', "{{status}}"),
    ], unit="reqps", stack=True, description="4xx and 5xx answers: 400 invalid, 429 queue full, 503 no engine, 504 deadline.")
    L.panel("Engine errors/s by code", [
        q(f"sum by (code) (rate(sluice:request_errors_total{{{ENGINE}}}{RATE}))", "{{code}}"),
    ], unit="reqps", stack=True, description="Error events engines sent, by sluice.wire error code.")
    L.panel("Finished completions/s by reason (engines)", [
        q(f"sum by (finished_reason) (rate(sluice:request_success_total{{{ENGINE}}}{RATE}))", "{{finished_reason}}"),
    ], unit="reqps", stack=True)

    L.row("Latency")
    L.panel("Time to first token (gateway: what clients see)",
            quantiles("sluice_gateway:time_to_first_token_seconds", GATEWAY), unit="s")
    L.panel("Time to first token (engine)", quantiles("sluice:time_to_first_token_seconds", ENGINE), unit="s",
            description="From the engine taking the request to its first token.")
    L.panel("Time per output token (engine)", quantiles("sluice:time_per_output_token_seconds", ENGINE), unit="s")
    L.panel("Inter-token latency", [
        *quantiles("sluice_gateway:inter_token_latency_seconds", GATEWAY, (0.5, 0.99), "gateway "),
        *quantiles("sluice:inter_token_latency_seconds", ENGINE, (0.5, 0.99), "engine "),
    ], unit="s")
    L.panel("End-to-end latency", [
        *quantiles("sluice_gateway:e2e_request_latency_seconds", GATEWAY, (0.5, 0.99), "gateway "),
        *quantiles("sluice:e2e_request_latency_seconds", ENGINE, (0.5, 0.99), "engine "),
    ], unit="s")
    L.panel("Queue time", [
        *quantiles("sluice:request_stream_queue_time_seconds", ENGINE, (0.5, 0.99), "Redis stream "),
        *quantiles("sluice:request_queue_time_seconds", ENGINE, (0.5, 0.99), "engine waiting "),
    ], unit="s", description="Time in the Redis stream (gateway XADD to engine read) and in the engine's waiting queue.")

    L.row("Capacity")
    L.panel("KV-cache usage", [
        q(f"sluice:kv_cache_usage_perc{{{ENGINE}}}", "{{engine_id}}"),
    ], unit="percentunit", max_value=1, description="Used KV blocks over the pool, per engine.")
    L.panel("Queue depth", [
        q(f"max by (model) (sluice_gateway:num_requests_waiting{{{GATEWAY}}})", "Redis queue {{model}}"),
        q(f"sum(sluice:num_requests_running{{{ENGINE}}})", "running"),
        q(f"sum(sluice:num_requests_waiting{{{ENGINE}}})", "waiting in engines"),
        q(f"sum(sluice:num_requests_preempted{{{ENGINE}}})", "preempted (waiting)"),
    ], unit="short", description="Requests queued in Redis (the gateways' view) and running / waiting in engines.")
    L.panel("Queue shards", [
        q(f"max by (shard) (sluice:queue_shard_depth{{{ENGINE}}})", "shard {{shard}}"),
    ], unit="short", stack=True, description="Entries waiting in each shard of the request queue (unread by any engine).")
    L.panel("Steals/s", [
        q(f"sum by (engine_id) (rate(sluice:queue_stolen_entries_total{{{ENGINE}}}{RATE}))", "{{engine_id}}"),
    ], unit="reqps", description="Entries engines took from shards they do not own (waited past the steal bound, "
                                 "or the owner was gone or saturated): high means the shards' owners lack room.")
    L.panel("Preemptions/s", [
        q(f"sum by (engine_id) (rate(sluice:num_preemptions_total{{{ENGINE}}}{RATE}))", "{{engine_id}}"),
    ], unit="short", description="Preemptions by recompute: the KV pool ran out while requests grew.")
    L.panel("Prefix-cache hit rate", [
        q(f"sum(rate(sluice:prefix_cache_hits_total{{{ENGINE}}}{RATE})) / "
          f"sum(rate(sluice:prefix_cache_queries_total{{{ENGINE}}}{RATE}))", "hit rate"),
    ], unit="percentunit", max_value=1, description="Share of admitted tokens served from the prefix cache.")
    L.panel("Engine step duration", quantiles("sluice:engine_step_duration_seconds", ENGINE), unit="s")
    L.panel("Batch size (sequences per step)", [
        *quantiles("sluice:batch_size", ENGINE, (0.5, 0.99)),
        q(f"sum(rate(sluice:batch_size_sum{{{ENGINE}}}{RATE})) / sum(rate(sluice:batch_size_count{{{ENGINE}}}{RATE}))",
          "mean"),
    ], unit="short")

    L.row("Faults")
    L.panel("Aborts/s by cause", [
        q(f"sum by (cause) (rate(sluice:request_aborts_total{{{ENGINE}}}{RATE}))", "{{cause}}"),
    ], unit="reqps", stack=True)
    L.panel("Reclaims and Redis reconnects", [
        q(f"sum(increase(sluice:reclaimed_requests_total{{{ENGINE}}}{RATE}))", "reclaimed entries"),
        q(f"sum by (connection) (increase(sluice:redis_reconnects_total{{{ENGINE}}}{RATE}))", "reconnect {{connection}}"),
    ], unit="short")
    L.panel("Lost events and requests", [
        q(f"sum(increase(sluice:redis_dropped_batches_total{{{ENGINE}}}{RATE}))", "event batches dropped (engines)"),
        q(f"sum by (code) (increase(sluice_gateway:requests_lost_total{{{GATEWAY}}}{RATE}))", "lost at gateways: {{code}}"),
        q(f"sum(increase(sluice:gateways_lost_total{{{ENGINE}}}{RATE}))", "gateways found gone"),
    ], unit="short", description="Anything above zero lost work: events an engine could not publish, "
                                 "requests a gateway answered 503 because Redis lost them.")
    L.panel("Engine request outcomes", [
        q(f"sum by (outcome) (increase(sluice:worker_requests_total{{{ENGINE}}}{RATE}))", "{{outcome}}"),
    ], unit="short", description="Requests the step loop refused, ended early or handed back (on drain).")
    L.panel("Engines", [
        q(f"count(sluice:kv_cache_blocks_total{{{ENGINE}}})", "engines reporting"),
        q(f"sum(sluice:engine_draining{{{ENGINE}}})", "draining"),
    ], unit="short")

    L.row("Load balancer")
    L.panel("Answers/s at the load balancer by HTTP class", [
        q(f"sum by (code) (rate(haproxy_backend_http_responses_total{{{LB}}}{RATE}))", "{{code}}"),
    ], unit="reqps", stack=True, description="What clients got through HAProxy, by status class: also the "
                                            "answers HAProxy made itself (503 with no gateway in rotation).")
    L.panel("Gateways in rotation", [
        q(f"max(haproxy_backend_active_servers{{{LB}}})", "gateways UP"),
        q(f"sum(increase(haproxy_server_check_failures_total{{{LB}}}{RATE}))", "failed health checks"),
    ], unit="short", description="Replicas passing GET /health (they leave after 3 failed checks, return after 1).")
    L.panel("Client connections, retries", [
        q(f"sum(haproxy_frontend_current_sessions{{{LB_FRONTEND}}})", "open client connections"),
        q(f"sum(haproxy_backend_current_queue{{{LB}}})", "queued in HAProxy"),
        q(f"sum(increase(haproxy_backend_retry_warnings_total{{{LB}}}{RATE}))", "retried on another gateway"),
        q(f"sum(increase(haproxy_backend_connection_errors_total{{{LB}}}{RATE}))", "connection errors"),
    ], unit="short", description="Open connections include SSE streams; a connection a gateway refused is "
                                 "retried on another replica.")

    def variable(name: str, query: str, label: str) -> dict:
        return {
            "name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
        }

    return {
        "uid": "sluice-overview",
        "title": "Sluice",
        "description": "Sluice engines and gateways: throughput, latency, KV cache, queues, preemptions, errors.",
        "tags": ["sluice", "llm", "inference"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            variable("model", "label_values(sluice:kv_cache_blocks_total, model)", "Model"),
            variable("engine_id", 'label_values(sluice:kv_cache_blocks_total{model=~"$model"}, engine_id)', "Engine"),
        ]},
        "panels": [{**p, "id": i + 1} for i, p in enumerate(L.panels)],
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
