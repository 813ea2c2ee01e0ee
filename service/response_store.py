"""`ResponseStore`: the Responses API's stored responses (service/openai_responses.py), in memory, bounded; on the loop
only."""
from __future__ import annotations

from dataclasses import dataclass
import msgspec

from service.openai_schema import _Message


@dataclass
class _Stored:
    body: bytes  # the response object's JSON, as it was answered
    turn_json: bytes  # its input messages, then its answer's (what a later turn's conversation takes from it), encoded
    messages: int  # how many
    previous: str | None  # the response it continued
    size: int  # bytes: the body's, the turn's and _ENTRY
    owner: str  # the client that made it (its address): whose share it takes

    @property
    def turn(self) -> list[_Message]:
        return _decode_turn(self.turn_json)


_decode_turn = msgspec.json.Decoder(list[_Message]).decode
# What a stored response costs beyond its JSON, counted so that many small responses cannot hold several times the
# bound: its id, its record, its places in the dicts and its owner's order (measured with tracemalloc, CPython 3.11:
# ~410 bytes, ~650 when every response has an owner of its own)
_ENTRY = 1024


class ResponseStore:
    """Stored responses by id, at most `max_bytes` of their JSON (each response's, encoded, and its turn's). A full
    store makes room from the client holding the most bytes, its least recently used first: a lone client may fill the
    whole store, but one that keeps storing can take no more than an equal share from the others (max-min fair, as
    the scheduler's turns are), so it cannot push out their conversations. A response keeps
    only its own turn and its predecessor's id, so a conversation costs what its turns do, once; one whose earlier
    turns were evicted (or deleted) can no longer be continued. The turns are kept encoded: as objects, short messages
    took 2-4x their JSON's bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: dict[str, _Stored] = {}
        self._owned: dict[str, dict[str, None]] = {}  # each owner's ids, least recently used first
        self._owner_bytes: dict[str, int] = {}
        self._bytes = 0

    def put(self, response_id: str, body: bytes, turn: list[_Message], previous: str | None,
            owner: str = "-") -> None:
        turn_json = msgspec.json.encode(turn)
        size = len(body) + len(turn_json) + _ENTRY
        if size > self.max_bytes:
            return  # (larger than the whole store: not kept, as with no store)
        self.delete(response_id)
        # copies as long as they are: msgspec's encodings keep their buffer's room to grow (up to half as much again)
        body, turn_json = bytes(memoryview(body)), bytes(memoryview(turn_json))
        self._items[response_id] = _Stored(body, turn_json, len(turn), previous, size, owner)
        self._owned.setdefault(owner, {})[response_id] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self._bytes += size
        while self._bytes > self.max_bytes:  # (the new one too, if its owner now holds the most)
            most = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            self.delete(next(iter(self._owned[most])))

    def get(self, response_id: str) -> _Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            owned = self._owned[stored.owner]
            owned[response_id] = owned.pop(response_id)  # (to the end: a dict, not an OrderedDict, costs half as much)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        owned = self._owned[stored.owner]
        del owned[response_id]
        self._bytes -= stored.size
        self._owner_bytes[stored.owner] -= stored.size
        if not owned:
            del self._owned[stored.owner], self._owner_bytes[stored.owner]
        return True

    def conversation(self, response_id: str, max_messages: int) -> list[_Message] | None:
        """The messages of the conversation that `response_id` ended, oldest first; None if any of its turns is gone.
        Raises `TooLong` past `max_messages` (a chain of a million one-token turns is not walked to its end)."""
        turns: list[_Stored] = []
        at: str | None = response_id
        count = 0
        while at is not None:
            stored = self.get(at)
            if stored is None:
                return None
            turns.append(stored)
            count += stored.messages
            if count > max_messages:
                raise TooLong(f"the conversation of previous_response_id has more than {max_messages} messages")
            at = stored.previous
        return [m for stored in reversed(turns) for m in stored.turn]


class TooLong(Exception):
    pass
