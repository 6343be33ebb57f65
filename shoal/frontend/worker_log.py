"""Log lines for workers joining and leaving, as the frontend's discovery sees them."""

from __future__ import annotations

import logging

from shoal.protocol import InstanceRecord
from shoal.runtime import InstanceEvent

log = logging.getLogger("shoal.frontend.workers")


def _describe(record: InstanceRecord) -> str:
    model = record.card.model_name if record.card is not None else "-"
    return f"{record.instance_id} model={model} address={record.address}"


class WorkerLog:
    """A discovery listener (`EndpointClient.add_listener`) logging each worker's arrival and
    departure once, with its id, model, address and the number of workers left."""

    def __init__(self) -> None:
        self.known: set[str] = set()

    def __call__(self, event: InstanceEvent) -> None:
        record = event.instance
        if event.kind == "added":
            if record.instance_id not in self.known:  # "added" again is a record update
                self.known.add(record.instance_id)
                log.info("worker joined: %s (%d workers)", _describe(record), len(self.known))
        elif record.instance_id in self.known:
            self.known.discard(record.instance_id)
            log.info("worker left: %s (%d workers)", _describe(record), len(self.known))
