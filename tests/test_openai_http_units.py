"""The HTTP API's parts in this process: the fair queue of clients, a streamed text chunk's
rendering.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from foundry.gateway.admission import FairQueue, QueueFull
from foundry.gateway.openai import sse
from foundry.gateway.openai.render import _Output, _Render
from foundry.wire import frontend as fw


def test_fair_queue_takes_clients_in_turn() -> None:
    async def main() -> list[str]:
        q = FairQueue(max_active=1, max_waiting=5)
        await q.acquire("a")  # runs
        order: list[str] = []

        async def wait(key: str) -> None:
            await q.acquire(key)
            order.append(key)

        tasks = [asyncio.ensure_future(wait(k)) for k in ("a", "a", "a", "b", "c")]
        await asyncio.sleep(0)
        assert q.waiting == 5
        with pytest.raises(QueueFull):
            await q.acquire("d")
        for _ in range(5):
            q.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    # a's burst does not keep b and c waiting: the keys take turns.
    assert asyncio.run(main()) == ["a", "b", "c", "a", "a"]


def test_fair_queue_skips_a_waiter_cancelled_before_it_woke() -> None:
    async def main() -> None:
        q = FairQueue(max_active=1, max_waiting=2)
        await q.acquire("a")
        gone = asyncio.ensure_future(q.acquire("b"))
        stays = asyncio.ensure_future(q.acquire("c"))
        await asyncio.sleep(0)
        gone.cancel()  # its future is cancelled now; its task runs only at the next turn
        q.release()  # so this must pass over it to c
        await stays
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert (q.active, q.waiting) == (1, 0)

    asyncio.run(main())


def test_fair_queue_forgets_a_waiter_that_leaves() -> None:
    async def main() -> None:
        q = FairQueue(max_active=1, max_waiting=1)
        await q.acquire("a")
        gone = asyncio.ensure_future(q.acquire("b"))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert q.waiting == 0
        q.release()
        assert q.active == 0
        await q.acquire("c")  # at once: nobody waits
        assert q.active == 1

    asyncio.run(main())


@pytest.mark.parametrize("chat", [True, False])
def test_a_text_chunk_is_its_whole_rendering(chat: bool) -> None:
    marker = "\u2063piece\u2063"
    render = _Render(chat, "cmpl-1", f'model "{marker}"', include_usage=False, logprobs=False)
    for piece in ["", "plain", 'quote " and \\ backslash', "é😀\n\t\x00", marker]:
        whole = sse(render._envelope([render._choice(piece, None)], True))
        assert render.chunk(piece, []) == whole
        assert json.loads(whole[len(b"data: ") :])["model"] == f'model "{marker}"'


def test_a_batch_cut_between_a_tokens_logprobs_and_its_text_keeps_them_together() -> None:
    """The leader sends a token's LOGPROBS, then its TOKEN; a batch of events may end between
    the two. Each streamed chunk's logprobs are its own text's tokens, so every text_offset
    counts the text before it: the same offsets as the whole response's."""
    lp = [fw.Logprobs(1, t, -0.5, f"tok{t} ".encode(), ()) for t in range(3)]
    tok = [fw.Token(1, t, 10 + t, f"tok{t} ") for t in range(3)]
    done = fw.Done(1, fw.DoneReason.MAX_TOKENS, 4, 3, 0.1)
    out = _Output(chat=False)
    render = _Render(False, "cmpl-1", "m", include_usage=False, logprobs=True)
    chunks = []
    for batch in ([lp[0], tok[0], lp[1]], [tok[1], lp[2]], [tok[2], done]):
        piece, lps = out.take(batch)
        assert [x.token for x in lps] == [x.token for x in batch if isinstance(x, fw.Token)]
        chunks.append(json.loads(render.chunk(piece, lps).decode().removeprefix("data: ")))
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    whole = _Render(False, "cmpl-2", "m", include_usage=False, logprobs=True).whole(out)
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"] == [0, 5, 10]
    assert out.done == done and "".join(out.text) == "tok0 tok1 tok2 "
