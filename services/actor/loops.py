"""The actor's loops, each started by main.py and ended by its shutdown:

- the rollout thread (`RolloutWorker`, local envs only; not a task: a thread of its own, so stepping
  never waits for the event loop): waits once for every policy's first weights from the learner, then
  runs `Rollout.collect` (services/actor/rollout.py) in a loop and hands each fragment, cut and
  serialized on this thread, to the event loop (`on_fragment`: main.py queues it on its policy's
  ShardLink with `loop.call_soon_threadsafe`). The shutdown's first step sets `stop_event`: the window
  in progress is cut short and every fragment cut with it is handed on. How the thread ended (None, or
  the exception) goes to `done`; main.py's "rollout-watch" task re-raises a crash, which ends the process.

The others are tasks on the event loop, one of each per policy (named with its tag where the run trains
several), in their own modules:

- "push": `ShardLink.run` (services/actor/shardlink.py) follows the buffer shards the planner sets and
  drives a `Pusher` (services/actor/push.py) for each shard it still delivers to, with its shard's
  insert-limit stream (`watch_insert_limit`, services/actor/subscribe.py) beside it. It ends once the
  shutdown's drain has everything queued acknowledged (or, past half the deadline, counted as dropped).
- "weights": `subscribe_weights` (services/actor/subscribe.py) keeps the learner's SubscribeWeights
  stream open and offers each complete version to the policy; cancelled at shutdown.
- "inference", with external simulator sessions only: `BatchedInference.run` (services/actor/inference.py)
  answers every pending step of the policy's sessions in one forward pass; cancelled at shutdown. The
  sessions themselves are served by their EnvSession calls (servicer.py, sessions.py), and their
  fragments are serialized on the encoder's thread (encoder.py).
"""

from __future__ import annotations

import logging
import threading

from services.actor.rollout import Rollout

log = logging.getLogger(__name__)


class RolloutWorker(threading.Thread):
    """Runs `Rollout.collect` in a loop, handing every fragment to `on_fragment` (thread-safe).

    Waits once, at start, for the learner's first weights; after that it never waits on the network,
    except where the buffer's rate limiter holds it before a fragment (limiter.py), or on-policy
    pacing (actor.fragments_per_version) holds it for the next weights.
    `done` (a callable) receives None on a clean stop or the exception that ended the thread.
    """

    def __init__(self, rollout: Rollout, on_fragment, done):
        super().__init__(name="rollout", daemon=True)
        self.rollout, self.on_fragment, self.done = rollout, on_fragment, done
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            waited = 0.0
            while not all(p.have_weights.wait(timeout=0.5 / len(self.rollout.policies))
                          for p in self.rollout.policies.values()):
                if self.stop_event.is_set():
                    self.done(None)
                    return
                waited += 0.5
                if waited % 10 == 0:
                    log.info("waiting for the learner's first weights (%.0f s)", waited)
            while not self.stop_event.is_set():
                msg = self.rollout.collect(self.stop_event)
                if msg is not None:
                    self.on_fragment(msg)
            for msg in self.rollout.take_pending():   # cut with the last one: sent like it, never lost
                self.on_fragment(msg)
        except BaseException as exc:  # handed to the event loop, which ends the process loudly
            self.done(exc)
            return
        self.done(None)
