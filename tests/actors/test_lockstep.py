"""What rank 0 broadcasts to the other ranks of a sharded model (``actors.lockstep``);
the ranks themselves run in tests/test_distributed.py."""

import pickle

import anyio
import mlx.core as mx
import numpy as np

from semantic.actors.gpu_thread import STEP
from semantic.actors.lockstep import Lockstep, _dumps
from semantic.actors.messages import BeginTurn, CacheRead, Message, TurnRequest
from semantic.runtime.store.cache_codec import HostCache
from semantic.runtime.cache_records import CacheRecord
from semantic.runtime.engine.engine import SamplingParams


def _turn(seed=None) -> BeginTurn:
    send, _ = anyio.create_memory_object_stream(1)
    request = TurnRequest(7, SamplingParams(temperature=0.7, seed=seed))
    return BeginTurn(request, "ann", (Message("user", "Hi"),), send, send)


def test_a_turn_travels_without_its_reply_stream_and_with_a_seed_drawn_on_rank_0():
    lockstep = Lockstep(mx.distributed.init())  # one process: a group of one
    sent = lockstep.send(_turn())
    assert sent.request.sampling.seed is not None  # every rank's sampler starts from the same key
    received = pickle.loads(_dumps(sent))
    assert received.reply is None and received.end is None and received.request == sent.request and received.messages == sent.messages
    assert lockstep.send(_turn(seed=5)).request.sampling.seed == 5  # a seed the client chose is kept
    assert lockstep.send(STEP) == STEP


def test_a_warm_cache_travels_as_the_tokens_rank_0_read():
    record = CacheRecord("ann", "m@rank0of3", "h", [1, 2, 3], "abc", 0.0, 0.0, [])
    host = HostCache(record, [], {"layer_0_keys": np.zeros((1, 1, 3, 64), np.uint32)})
    received = pickle.loads(_dumps(CacheRead("ann", "m@rank0of3", host)))
    assert received.cache.tokens == (1, 2, 3) and len(_dumps(received)) < 300  # no arrays on the wire


def test_a_large_input_takes_more_than_one_frame():
    lockstep = Lockstep(mx.distributed.init())
    data = bytes(range(256)) * 40  # past the first 4 KiB frame
    assert lockstep._broadcast(data) == data
