#!/usr/bin/env node
// Cars at a one-lane crossing, written in JavaScript: a simulator of several agents that come and go,
// each car an agent of one Actor.EnvSession session (hello.agent_ids; docs/multi-agent.md, "Agents
// over EnvSession"), all driven by the actor's one policy.
//
//   node crossing.js --actor HOST:PORT [--steps S] [--cars K] [--session ID] [--seed K]
//
// Cars arrive at random (probability 0.3 a step, ids car-0..car-{K-1}; an id whose car left is used
// again by a later car, which then *joins* the session again). Each waiting car sees 4 floats: whether
// it is first in line, whether the crossing is taken, the other cars waiting / K, its wait / 30. It
// chooses 0 (wait) or 1 (go). A car that goes alone onto a free crossing passes (+1); cars that go
// while it is taken, or two or more at once, crash (-1 each); waiting costs 0.02 a step, and a car
// that waited 30 steps gives up (truncated). A car whose episode ended leaves; the crossing is taken
// for the step after a car passed. Going at random crashes most cars; the best rule (the first in line
// goes when the crossing is free) passes every car. Run it against `kuberl up configs/crossing_external.yaml`.
//
// Each step names the cars acting on it (EnvStep.agents); its rewards, terminated, truncated and
// final_observations are of the cars that acted on the step before, in that order; returning ids are
// listed in EnvStep.joined. The last line on stdout is a JSON summary; exit 0 after --steps steps,
// 1 with the gRPC status on stderr.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DTYPE_BOOL, DTYPE_FLOAT32, decodeDiscrete, rng, tensor } = require('../node-common/envsession');

const OBS_DIM = 4;
const ARRIVAL = 0.3;
const MAX_WAIT = 30;
const WAIT_COST = 0.02;

function parse(argv) {
  const opts = { actor: null, steps: 2000, cars: 6, session: `node-crossing-${process.pid}`, seed: 0, replyTimeout: 300 };
  const names = { '--actor': 'actor', '--steps': 'steps', '--cars': 'cars', '--session': 'session', '--seed': 'seed',
    '--reply-timeout': 'replyTimeout' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) {
      console.error(`usage: node crossing.js --actor HOST:PORT [--steps S] [--cars K] [--session ID] [--seed K] ` +
        `[--reply-timeout S] (bad argument ${argv[i]})`);
      process.exit(2);
    }
    opts[key] = key === 'actor' || key === 'session' ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!opts.actor) { console.error('crossing.js: --actor HOST:PORT is required'); process.exit(2); }
  if (!(opts.cars >= 2 && opts.cars <= 64)) { console.error('crossing.js: --cars must be 2..64'); process.exit(2); }
  return opts;
}

// The crossing: which cars wait (in arrival order), how long each has, whether the crossing is taken.
class Crossing {
  constructor(ids, random) {
    this.ids = ids;
    this.random = random;
    this.line = []; // car ids waiting, first in line first
    this.wait = new Map();
    this.taken = false;
    this.everSeen = new Set();
    this.joining = []; // cars arriving with an id that stepped before (EnvStep.joined)
  }

  observe(id) {
    const others = this.line.length - 1;
    return [this.line[0] === id ? 1 : 0, this.taken ? 1 : 0, others / this.ids.length, this.wait.get(id) / MAX_WAIT];
  }

  arrive(force) {
    this.joining = [];
    const free = this.ids.filter((id) => !this.wait.has(id));
    if (free.length && (force || this.random() < ARRIVAL)) {
      const id = free[0];
      this.line.push(id);
      this.wait.set(id, 0);
      if (this.everSeen.has(id)) this.joining.push(id);
      this.everSeen.add(id);
    }
  }

  // Apply one action per car of `acting` (in that order); the outcome of each, in that order.
  step(acting, actions) {
    const goers = acting.filter((id, k) => actions[k] === 1);
    const wasTaken = this.taken;
    const crash = wasTaken || goers.length > 1;
    this.taken = !crash && goers.length === 1;
    const out = acting.map((id, k) => {
      const go = actions[k] === 1;
      if (go) return { id, reward: crash ? -1 : 1, terminated: true, truncated: false, kind: crash ? 'crashed' : 'passed' };
      this.wait.set(id, this.wait.get(id) + 1);
      const gaveUp = this.wait.get(id) >= MAX_WAIT;
      return { id, reward: -WAIT_COST, terminated: false, truncated: gaveUp, kind: gaveUp ? 'gave_up' : null };
    });
    for (const o of out) {
      if (o.terminated || o.truncated) o.final = this.observe(o.id); // the true last observation
    }
    for (const o of out) {
      if (o.terminated || o.truncated) {
        this.line = this.line.filter((id) => id !== o.id);
        this.wait.delete(o.id);
      }
    }
    this.arrive(this.line.length === 0); // never an empty crossing: the session always has a car acting
    return out;
  }
}

function main() {
  const opts = parse(process.argv.slice(2));
  const ids = Array.from({ length: opts.cars }, (_, i) => `car-${i}`);
  const crossing = new Crossing(ids, rng(opts.seed));
  crossing.arrive(true);
  crossing.arrive(true);
  const packageDefinition = protoLoader.loadSync('kuberl/v1/actor.proto', {
    includeDirs: [path.resolve(__dirname, '../../protos')], keepCase: true, longs: Number, enums: Number,
    defaults: true, oneofs: true,
  });
  const kuberl = grpc.loadPackageDefinition(packageDefinition).kuberl.v1;
  const client = new kuberl.Actor(opts.actor, grpc.credentials.createInsecure());
  const stream = client.EnvSession();
  const returns = new Map(); // the running return of each car waiting
  const finished = []; // every car's return, in the order they left
  const counts = { passed: 0, crashed: 0, gave_up: 0, joined: 0 };
  let steps = 0;
  let agentSteps = 0;
  let acting = [];
  let stepId = 0;
  let policyFirst = null;
  let policyLast = null;
  let done = false;
  let lastHeard = Date.now();

  function fail(what) {
    if (done) return;
    done = true;
    process.stderr.write(`${what}\n`, () => process.exit(1));
  }

  function observations(cars) {
    const obs = new Float32Array(cars.length * OBS_DIM);
    cars.forEach((id, k) => obs.set(crossing.observe(id), k * OBS_DIM));
    return tensor(DTYPE_FLOAT32, [cars.length, OBS_DIM], obs);
  }

  function send(outcomes) {
    acting = [...crossing.line];
    const step = { step_id: stepId, agents: acting, joined: crossing.joining, observations: observations(acting) };
    counts.joined += crossing.joining.length;
    for (const id of acting) if (!returns.has(id)) returns.set(id, 0);
    if (outcomes) {
      const n = outcomes.length;
      step.rewards = tensor(DTYPE_FLOAT32, [n], Float32Array.from(outcomes, (o) => o.reward));
      step.terminated = tensor(DTYPE_BOOL, [n], Uint8Array.from(outcomes, (o) => (o.terminated ? 1 : 0)));
      step.truncated = tensor(DTYPE_BOOL, [n], Uint8Array.from(outcomes, (o) => (o.truncated ? 1 : 0)));
      const ended = outcomes.filter((o) => o.final);
      if (ended.length) {
        const fin = new Float32Array(ended.length * OBS_DIM);
        ended.forEach((o, k) => fin.set(o.final, k * OBS_DIM));
        step.final_observations = tensor(DTYPE_FLOAT32, [ended.length, OBS_DIM], fin);
      }
    }
    stream.write({ step });
    stepId += 1;
  }

  stream.write({
    hello: {
      session_id: opts.session, agent_ids: ids, num_envs: 0, simulator: 'node-crossing',
      observation_space: { box: { shape: [OBS_DIM], dtype: DTYPE_FLOAT32 } },
      action_space: { discrete: { n: 2 } },
    },
  });

  stream.on('data', (msg) => {
    lastHeard = Date.now();
    try {
      if (msg.kind === 'accepted') {
        send(null);
        return;
      }
      if (msg.kind !== 'actions') throw new Error(`unexpected ActorMessage ${msg.kind}`);
      if (Number(msg.actions.step_id) !== stepId - 1) throw new Error(`ActionReply.step_id ${msg.actions.step_id}`);
      if (steps >= opts.steps) return; // the answer to the last step: nothing to apply
      const actions = decodeDiscrete(msg.actions.actions, acting.length, 2);
      policyLast = Number(msg.actions.policy_version);
      if (policyFirst === null) policyFirst = policyLast;
      const outcomes = crossing.step(acting, actions);
      agentSteps += outcomes.length;
      for (const o of outcomes) {
        returns.set(o.id, returns.get(o.id) + o.reward);
        if (o.kind) {
          counts[o.kind] += 1;
          finished.push(returns.get(o.id));
          returns.delete(o.id);
        }
      }
      steps += 1;
      send(outcomes);
      if (steps >= opts.steps) stream.end(); // half-close: the actor flushes the session's fragments
    } catch (e) {
      fail(`protocol error: ${e.message}`);
      stream.cancel();
    }
  });
  stream.on('error', (err) => fail(`EnvSession failed: gRPC status ${err.code}: ${err.details}`));
  stream.on('status', (status) => {
    if (status.code !== grpc.status.OK || done) return;
    done = true;
    clearInterval(timer);
    client.close();
    const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
    const summary = {
      steps, agent_steps: agentSteps, cars: finished.length, ...counts,
      mean_return_first_100: mean(finished.slice(0, 100)), mean_return_last_100: mean(finished.slice(-100)),
      policy_version_first: policyFirst, policy_version_last: policyLast,
    };
    process.stdout.write(`${JSON.stringify(summary)}\n`, () => process.exit(0));
  });
  const timer = setInterval(() => {
    if (Date.now() - lastHeard > opts.replyTimeout * 1000) {
      fail(`no answer from the actor for ${opts.replyTimeout} s`);
      stream.cancel();
    }
  }, 500);
}

main();
