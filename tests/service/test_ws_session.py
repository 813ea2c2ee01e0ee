"""The WebSocket protocol without a socket (service/ws_session.py): frames in, server messages out, over a real
`Service` whose engine is never started; handles are fed by hand, as the bridge would feed them."""
from __future__ import annotations

from service.handle import RequestHandle
from service.openai_reasoning import ThinkStream
from service.protocol import Cancel, Chat, Delta, Done, Error, Hello, Ping, Pong, Start, StatsRequest, decode_client
from service.ws_session import CONTROL_HIGH_WATER, Session, _Chat
from tests.service.conftest import idle_service


def _session(**config: object) -> tuple[Session, list[int]]:
    wakes: list[int] = []
    return Session(idle_service(**config), lambda: wakes.append(1)), wakes


def _chat(session: Session, chat_id: str, think: ThinkStream | None = None) -> RequestHandle:
    """A chat in flight, as `receive(Chat)` leaves one once the bridge took it."""
    handle = RequestHandle(f"r-{chat_id}", "ws", lambda: session._mark(chat_id))
    session.chats[chat_id] = _Chat(chat_id, handle, think)
    return handle


def _tags(frames: list) -> list[str]:
    return [f.__struct_config__.tag for f in frames]


def test_slow_reader_gets_merged_deltas_then_done() -> None:
    session, wakes = _session()
    h = _chat(session, "c1")
    h.start(7, 4, h.arrival)
    for piece in ["Hel", "lo", ", ", "wor", "ld"]:  # five engine steps before the writer asks once
        h.push(piece, 1, None)
        h.notify()
    h.finish("stop", None)
    h.notify()
    frames = session.next_frames()
    assert _tags(frames) == ["start", "delta", "done"] and wakes
    start, delta, done = frames
    assert (start.prompt_tokens, start.cached_tokens) == (7, 4)
    assert (delta.text, delta.tokens) == ("Hello, world", 5)
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 5
    assert "c1" not in session.chats and session.next_frames() == []


def test_withheld_text_carries_its_tokens_to_the_next_delta() -> None:
    session, _ = _session()
    h = _chat(session, "c")
    h.start(1, 0, h.arrival)
    h.push("", 1, None)  # half a UTF-8 character: the engine withholds its text
    h.notify()
    assert _tags(session.next_frames()) == ["start"]
    h.push("é", 1, None)
    h.notify()
    (delta,) = session.next_frames()
    assert isinstance(delta, Delta) and (delta.text, delta.tokens) == ("é", 2)


def test_reasoning_comes_apart_and_a_held_tag_is_flushed_at_the_end() -> None:
    """`--reasoning-parser`: the text a tag's start holds back goes out with the next delta (its tokens with it), and
    what is held when the chat ends goes out before `done`."""
    session, _ = _session()
    h = _chat(session, "c", ThinkStream("deepseek_r1"))
    h.start(1, 0, h.arrival)
    for piece in ["Let me", " see.</th", "ink>It is 4"]:
        h.push(piece, 1, None)
        h.notify()
        frames = session.next_frames()
        frames = frames[1:] if _tags(frames)[0] == "start" else frames
        assert [(f.reasoning, f.text, f.tokens) for f in frames] == {
            "Let me": [("Let me", "", 1)], " see.</th": [(" see.", "", 1)], "ink>It is 4": [("", "It is 4", 1)]}[piece]
    h.finish("stop", None)
    h.notify()
    assert _tags(session.next_frames()) == ["done"]
    h = _chat(session, "d", ThinkStream("deepseek_r1"))
    h.start(1, 0, h.arrival)
    h.push("Hm.</th", 1, None)
    h.finish("length", None)
    h.notify()
    _, delta, done = session.next_frames()
    assert (delta.reasoning, delta.text, delta.tokens) == ("Hm.</th", "", 1) and done.finish_reason == "length"
    h = _chat(session, "e", ThinkStream("deepseek_r1"))
    h.start(1, 0, h.arrival)
    h.push("Hm.</th", 1, None)
    h.notify()
    _, delta = session.next_frames()
    assert (delta.reasoning, delta.text, delta.tokens) == ("Hm.", "", 1)
    h.finish("length", None)
    h.notify()
    delta, _ = session.next_frames()  # (the tag's start held back: an unfinished tag stays reasoning)
    assert (delta.reasoning, delta.text, delta.tokens) == ("</th", "", 0)


def test_an_aborted_chat_is_done_cancelled() -> None:
    session, _ = _session()
    h = _chat(session, "c")
    h.start(3, 0, h.arrival)
    h.finish("abort", None)
    h.notify()
    frames = session.next_frames()
    assert _tags(frames) == ["start", "done"] and frames[1].finish_reason == "cancelled"


def test_control_replies_come_before_chat_output_and_in_order() -> None:
    session, _ = _session()
    h = _chat(session, "c")
    h.start(1, 0, h.arrival)
    h.notify()
    session.receive(Ping(data=decode_client('{"type": "ping", "data": 1}').data))  # type: ignore[union-attr]
    session.receive(Cancel(id="nope"))
    frames = session.next_frames()
    assert isinstance(frames[0], Pong) and isinstance(frames[1], Error) and frames[1].code == "unknown_id"
    assert _tags(session.next_frames()) == ["start"]


def test_frame_errors_and_limits() -> None:
    session, _ = _session(max_inflight_per_connection=1)
    _chat(session, "a")
    chat = decode_client('{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}]}')
    assert isinstance(chat, Chat)
    session.receive(chat)  # the id is in flight
    session.receive(Chat(id="b", messages=chat.messages))  # one chat per connection here
    bad = decode_client('{"type": "chat", "id": "a", "messages": []}')
    session.receive(bad)  # an invalid frame for an id in flight is reported frame-level, not as that chat's end
    codes = [(f.code, f.id) for f in session.next_frames()]
    # the in-flight id must not see a second terminal message: both its errors are frame-level
    assert codes == [("duplicate_id", None), ("too_many_inflight", "b"), ("invalid_message", None)]


def test_backlog_is_bounded_in_replies_and_bytes_and_a_wrong_hello_closes() -> None:
    session, _ = _session(api_key="k")
    for _ in range(CONTROL_HIGH_WATER):
        session.receive(StatsRequest())
    assert session.backlogged
    assert len(session.next_frames()) == CONTROL_HIGH_WATER and not session.backlogged
    big = decode_client('{"type": "ping", "data": "' + "x" * (1 << 20) + '"}')  # a frame's worth of data
    for _ in range(3):
        session.receive(big)
    assert not session.backlogged
    session.receive(big)  # four unsent: 4 MB of pongs held, not 256 (256 MB) before the connection stops reading
    assert session.backlogged
    assert len(session.next_frames()) == 4 and not session.backlogged
    session.receive(Hello(api_key="wrong"))
    assert [f.code for f in session.next_frames()] == ["unauthorized"] and session.close_code == 1008
    session.receive(StatsRequest())  # closing: ignored
    assert session.next_frames() == []


def test_draining_refuses_new_chats() -> None:
    session, _ = _session()
    session.svc.draining = True
    chat = decode_client('{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}]}')
    session.receive(chat)
    (err,) = session.next_frames()
    assert (err.code, err.id) == ("overloaded", "a") and not session.chats


def test_done_frames_carry_start_when_the_chat_ended_before_it_was_sent() -> None:
    session, _ = _session()
    h = _chat(session, "c")
    h.start(2, 0, h.arrival)
    h.push("hi", 1, None)
    h.finish("length", None)
    h.notify()
    frames = session.next_frames()
    assert _tags(frames) == ["start", "delta", "done"] and isinstance(frames[0], Start) and isinstance(frames[2], Done)
