"""Prefect events the platform emits, which deployment triggers (deploy/prefect.yaml) start cycles on.

    atlas.snapshot.added      resource atlas.snapshot.<line>.<skill>   payload: path, sha256, pairs
    atlas.candidate.submitted resource atlas.candidate.<model>         payload: version, version_id, parent, kind

An event goes to the Prefect server named by PREFECT_API_URL; without one nothing is sent (no server
would hear it; the next scheduled cycle takes the data, `atlas gate check` judges the candidate).
"""

from __future__ import annotations

import os

from atlas_core.errors import InputError

SNAPSHOT_ADDED = "atlas.snapshot.added"
CANDIDATE_SUBMITTED = "atlas.candidate.submitted"


def emit(event: str, resource_id: str, labels: dict[str, str], payload: dict) -> bool:
    """Send one event and wait until it is delivered; False when no server is configured."""
    if not os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    sent = emit_event(event=event, resource={"prefect.resource.id": resource_id, **labels}, payload=payload)
    EventsWorker.drain_all()  # a command exits right after: deliver before it does
    if sent is None:
        raise InputError(f"event {event}: Prefect did not emit it (events disabled in this profile?)")
    return True
