"""The tqkv client an engine plug-in builds from its extra configuration (shared by the
vLLM connector and the SGLang HiCache back-end).

Keys (all optional): tqkv_targets (a list, or one comma-separated string; default
127.0.0.1:7000), tqkv_replicas, tqkv_token or tqkv_token_file (a mounted Secret: its
first line), tqkv_tls_ca, tqkv_tls_target_name, tqkv_transport (default "tcp"),
tqkv_resolve_targets.
"""
from typing import Any, List, Mapping, Optional

from . import client as _client


def targets_of(extra: Mapping[str, Any]) -> List[str]:
    """tqkv_targets as a list of host:port strings."""
    targets = extra.get("tqkv_targets", ["127.0.0.1:7000"])
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return list(targets)


def token_of(extra: Mapping[str, Any]) -> Optional[str]:
    """tqkv_token, or the first line of tqkv_token_file (a mounted Secret)."""
    token = extra.get("tqkv_token")
    if token is None and extra.get("tqkv_token_file"):
        with open(extra["tqkv_token_file"]) as f:
            token = f.readline().strip() or None
    return token


def client_from_extra(extra: Mapping[str, Any], deadline_ms: int) -> "_client.Client":
    """A tqkv Client for an engine plug-in's extra configuration."""
    return _client.Client(
        targets_of(extra), replicas=int(extra.get("tqkv_replicas", 1)), token=token_of(extra),
        tls_ca=extra.get("tqkv_tls_ca"), tls_target_name=extra.get("tqkv_tls_target_name"),
        transport=extra.get("tqkv_transport", "tcp"), deadline_ms=deadline_ms,
        wait_for_ready=False, resolve_targets=bool(extra.get("tqkv_resolve_targets", False)))
