"""Crafted snapshots for the trust tests: a committed manifest rewritten as an attacker would, with
its checksum recomputed exactly as storage/format/manifest.py computes it (so only validation can refuse it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import blake3


def checksum(body: dict[str, Any]) -> str:
    """FORMAT.md's canonical encoding of every field but `checksum`, hashed with BLAKE3."""
    return blake3.blake3(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def resummarize(body: dict[str, Any]) -> None:
    """Make BODY's `summary` (where it has one) agree with its streams, as an attacker would."""
    if "summary" in body:
        body["summary"] = {"size": sum(c[1] for s in body["streams"] for c in s["chunks"]),
                           "streams": len(body["streams"])}


def rewrite_manifest(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply CHANGE to the manifest at PATH (its body, without the checksum), re-sign it, write it back."""
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    change(body)
    resummarize(body)
    body["checksum"] = checksum(body)
    path.write_text(json.dumps(body, sort_keys=True, indent=1))
    return body
