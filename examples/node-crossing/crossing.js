#!/usr/bin/env node
// Cars at a one-lane crossing, written in JavaScript: a simulator of several agents that come and go,
// each car an agent of one Actor.EnvSession session (hello.agent_ids; docs/multi-agent.md, "Agents
// over EnvSession"), all driven by the actor's one policy. With --buses B, buses come too, played by a
// second policy with spaces of its own (docs/multi-agent.md, "Several policies over EnvSession"): the
// cars are one session (hello.policy "car"), the buses another ("bus"), stepped together.
//
//   node crossing.js --actor HOST:PORT [--steps S] [--cars K] [--buses B] [--session ID] [--seed K]
//
// Cars arrive at random (probability 0.3 a step, ids car-0..car-{K-1}; an id whose car left is used
// again by a later car, which then *joins* the session again). Each waiting car sees 4 floats: whether
// it is first in line, whether the crossing is taken, the other vehicles waiting / (K + B), its wait /
// 30. It chooses 0 (wait) or 1 (go). The first in line has the right of way: going onto a free crossing
// it passes (a car +1), and any other vehicle going with it crashes (-1); when the first in line waits,
// a vehicle that goes alone passes and two or more at once crash. A vehicle that goes while the crossing
// is taken crashes. Waiting costs a car 0.02 a step, and a vehicle that waited 30 steps gives up
// (truncated). A vehicle whose episode ended leaves; the crossing is taken for the step after one
// passed. Going at random crashes most cars; the best rule (the first in line goes when the crossing is
// free, the others wait) passes every car, whatever the other vehicles do. Buses (ids
// bus-0..bus-{B-1}, probability 0.1 a step) carry more: one passing scores +2 and waiting costs it
// 0.05 a step; each sees a fifth float, the buses waiting / B. Each kind always has one waiting (one
// arrives when none does), so each session has an agent acting at every step. Run it against `kuberl
// up configs/crossing_external.yaml` (cars) or `configs/crossing_buses_external.yaml` (--buses).
//
// Each step names the vehicles acting on it (EnvStep.agents); its rewards, terminated, truncated and
// final_observations are of the vehicles that acted on the session's step before, in that order;
// returning ids are listed in EnvStep.joined. The last line on stdout is a JSON summary (with --buses,
// each kind's under `policies`); exit 0 after --steps steps, 1 with the gRPC status on stderr.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { DTYPE_FLOAT32, agentsStep, decodeDiscrete, rng } = require('../node-common/envsession');

const MAX_WAIT = 30;
// What each kind of vehicle is: how often one arrives, what passing and waiting are worth, what it sees.
const KINDS = {
  car: { arrival: 0.3, pass: 1, waitCost: 0.02, obsDim: 4 },
  bus: { arrival: 0.1, pass: 2, waitCost: 0.05, obsDim: 5 },
};

function parse(argv) {
  const opts = { actor: null, steps: 2000, cars: 6, buses: 0, session: `node-crossing-${process.pid}`, seed: 0,
    replyTimeout: 300 };
  const names = { '--actor': 'actor', '--steps': 'steps', '--cars': 'cars', '--buses': 'buses', '--session': 'session',
    '--seed': 'seed', '--reply-timeout': 'replyTimeout' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) {
      console.error(`usage: node crossing.js --actor HOST:PORT [--steps S] [--cars K] [--buses B] [--session ID] ` +
        `[--seed K] [--reply-timeout S] (bad argument ${argv[i]})`);
      process.exit(2);
    }
    opts[key] = key === 'actor' || key === 'session' ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!opts.actor) { console.error('crossing.js: --actor HOST:PORT is required'); process.exit(2); }
  if (!(opts.cars >= 2 && opts.cars <= 64)) { console.error('crossing.js: --cars must be 2..64'); process.exit(2); }
  if (!(opts.buses >= 0 && opts.buses <= 64)) { console.error('crossing.js: --buses must be 0..64'); process.exit(2); }
  return opts;
}

const kindOf = (id) => id.slice(0, id.indexOf('-'));

// The crossing: which vehicles wait (in arrival order), how long each has, whether the crossing is taken.
class Crossing {
  constructor(ids, random) {
    this.ids = ids; // kind -> its vehicle ids
    this.total = Object.values(ids).reduce((n, xs) => n + xs.length, 0);
    this.random = random;
    this.line = []; // vehicle ids waiting, first in line first
    this.wait = new Map();
    this.taken = false;
    this.everSeen = new Set();
    this.joining = []; // vehicles arriving with an id that stepped before (EnvStep.joined)
  }

  waiting(kind) {
    return this.line.filter((id) => kindOf(id) === kind);
  }

  observe(id) {
    const kind = kindOf(id);
    const obs = [this.line[0] === id ? 1 : 0, this.taken ? 1 : 0, (this.line.length - 1) / this.total,
      this.wait.get(id) / MAX_WAIT];
    if (kind === 'bus') obs.push(this.waiting('bus').length / this.ids.bus.length);
    return obs;
  }

  // A vehicle of each kind may arrive; one surely does where none of its kind waits (each session
  // always has a vehicle acting), or with `force`.
  arrive(force = false) {
    this.joining = [];
    for (const [kind, ids] of Object.entries(this.ids)) {
      const free = ids.filter((id) => !this.wait.has(id));
      const surely = force || this.waiting(kind).length === 0;
      if (free.length && (surely || this.random() < KINDS[kind].arrival)) {
        const id = free[0];
        this.line.push(id);
        this.wait.set(id, 0);
        if (this.everSeen.has(id)) this.joining.push(id);
        this.everSeen.add(id);
      }
    }
  }

  // Apply one action per vehicle of `acting` (in that order); the outcome of each, in that order.
  step(acting, actions) {
    const goers = acting.filter((id, k) => actions[k] === 1);
    // Who passes, if anyone: none onto a taken crossing; else the first in line where it goes (the right
    // of way), else the one vehicle going where only one goes. Every other vehicle going crashes.
    let passer = null;
    if (!this.taken) {
      if (goers.includes(this.line[0])) passer = this.line[0];
      else if (goers.length === 1) passer = goers[0];
    }
    this.taken = passer !== null;
    const out = acting.map((id, k) => {
      const kind = KINDS[kindOf(id)];
      if (actions[k] === 1) {
        const passed = id === passer;
        return { id, reward: passed ? kind.pass : -1, terminated: true, truncated: false, kind: passed ? 'passed' : 'crashed' };
      }
      this.wait.set(id, this.wait.get(id) + 1);
      const gaveUp = this.wait.get(id) >= MAX_WAIT;
      return { id, reward: -kind.waitCost, terminated: false, truncated: gaveUp, kind: gaveUp ? 'gave_up' : null };
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
    this.arrive();
    return out;
  }
}

// One kind of vehicle's session: its stream, the vehicles acting on its last step, its tallies.
class Team {
  constructor(kind, policy, ids, client, crossing, session) {
    Object.assign(this, { kind, policy, ids, crossing, session, obsDim: KINDS[kind].obsDim });
    this.stream = client.EnvSession();
    this.acting = [];
    this.stepId = 0;
    this.reply = null; // the actions of its last step, once they came
    this.returns = new Map(); // the running return of each vehicle waiting
    this.finished = []; // every vehicle's return, in the order they left
    this.counts = { passed: 0, crashed: 0, gave_up: 0, joined: 0 };
    this.agentSteps = 0;
    this.versionFirst = null; // the policy versions of its first and last replies
    this.versionLast = null;
  }

  hello() {
    this.stream.write({
      hello: {
        session_id: this.session, agent_ids: this.ids, num_envs: 0, simulator: 'node-crossing', policy: this.policy,
        observation_space: { box: { shape: [this.obsDim], dtype: DTYPE_FLOAT32 } },
        action_space: { discrete: { n: 2 } },
      },
    });
  }

  // The team's next step: its vehicles waiting now, and the outcomes of those that acted before.
  send(outcomes) {
    this.acting = this.crossing.waiting(this.kind);
    const joined = this.crossing.joining.filter((id) => kindOf(id) === this.kind);
    // (an empty team would go as a step of no agents, EnvStep.no_agents; here one always waits)
    const step = agentsStep(this.stepId, this.acting, this.acting.map((id) => this.crossing.observe(id)), this.obsDim,
      outcomes, joined);
    this.counts.joined += joined.length;
    if (outcomes) {
      this.agentSteps += outcomes.length;
      for (const o of outcomes) {
        this.returns.set(o.id, this.returns.get(o.id) + o.reward);
        if (o.kind) {
          this.counts[o.kind] += 1;
          this.finished.push(this.returns.get(o.id));
          this.returns.delete(o.id);
        }
      }
    }
    // (after the outcomes: an id whose vehicle just left may be a new arrival's already)
    for (const id of this.acting) if (!this.returns.has(id)) this.returns.set(id, 0);
    this.reply = null;
    this.stream.write({ step });
    this.stepId += 1;
  }

  summary() {
    const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
    return { agent_steps: this.agentSteps, [this.kind === 'car' ? 'cars' : 'vehicles']: this.finished.length,
      ...this.counts, mean_return_first_100: mean(this.finished.slice(0, 100)),
      mean_return_last_100: mean(this.finished.slice(-100)), policy_version_first: this.versionFirst,
      policy_version_last: this.versionLast };
  }
}

function main() {
  const opts = parse(process.argv.slice(2));
  const ids = { car: Array.from({ length: opts.cars }, (_, i) => `car-${i}`) };
  if (opts.buses) ids.bus = Array.from({ length: opts.buses }, (_, i) => `bus-${i}`);
  const crossing = new Crossing(ids, rng(opts.seed));
  crossing.arrive(true);
  crossing.arrive(true);
  const packageDefinition = protoLoader.loadSync('kuberl/v1/actor.proto', {
    includeDirs: [path.resolve(__dirname, '../../protos')], keepCase: true, longs: Number, enums: Number,
    defaults: true, oneofs: true,
  });
  const kuberl = grpc.loadPackageDefinition(packageDefinition).kuberl.v1;
  const client = new kuberl.Actor(opts.actor, grpc.credentials.createInsecure());
  // One session per policy where buses come (each kind its own policy), else one of cars.
  const teams = Object.keys(ids).map((kind) => new Team(kind, opts.buses ? kind : '', ids[kind], client, crossing,
    opts.buses ? `${opts.session}/${kind}` : opts.session));
  let steps = 0;
  let accepted = 0;
  let done = false;
  let closed = 0;
  let lastHeard = Date.now();

  function fail(what) {
    if (done) return;
    done = true;
    process.stderr.write(`${what}\n`, () => process.exit(1));
  }

  // Every team's actions came: apply them together, then send every team its next step.
  function advance() {
    const acting = teams.flatMap((t) => t.acting);
    const actions = teams.flatMap((t) => Array.from(t.reply));
    const outcomes = crossing.step(acting, actions);
    steps += 1;
    for (const t of teams) t.send(outcomes.filter((o) => kindOf(o.id) === t.kind));
    if (steps >= opts.steps) for (const t of teams) t.stream.end(); // half-close: the actor flushes the fragments
  }

  function finish() {
    done = true;
    clearInterval(timer);
    client.close();
    const parts = teams.map((t) => t.summary());
    const summary = teams.length === 1 ? { steps, ...parts[0] } : {
      steps, agent_steps: parts.reduce((n, p) => n + p.agent_steps, 0),
      policies: Object.fromEntries(teams.map((t, k) => [t.kind, parts[k]])),
    };
    process.stdout.write(`${JSON.stringify(summary)}\n`, () => process.exit(0));
  }

  for (const team of teams) {
    team.stream.on('data', (msg) => {
      lastHeard = Date.now();
      try {
        if (msg.kind === 'accepted') {
          accepted += 1;
          if (accepted === teams.length) for (const t of teams) t.send(null);
          return;
        }
        if (msg.kind !== 'actions') throw new Error(`unexpected ActorMessage ${msg.kind}`);
        if (Number(msg.actions.step_id) !== team.stepId - 1) throw new Error(`ActionReply.step_id ${msg.actions.step_id}`);
        if (steps >= opts.steps) return; // the answer to the last step: nothing to apply
        team.reply = decodeDiscrete(msg.actions.actions, team.acting.length, 2);
        team.versionLast = Number(msg.actions.policy_version);
        if (team.versionFirst === null) team.versionFirst = team.versionLast;
        if (teams.every((t) => t.reply !== null)) advance();
      } catch (e) {
        fail(`protocol error: ${e.message}`);
        for (const t of teams) t.stream.cancel();
      }
    });
    team.stream.on('error', (err) => fail(`EnvSession ${team.session} failed: gRPC status ${err.code}: ${err.details}`));
    team.stream.on('status', (status) => {
      if (status.code !== grpc.status.OK || done) return;
      closed += 1;
      if (closed === teams.length) finish();
    });
    team.hello();
  }
  const timer = setInterval(() => {
    if (Date.now() - lastHeard > opts.replyTimeout * 1000) {
      fail(`no answer from the actor for ${opts.replyTimeout} s`);
      for (const t of teams) t.stream.cancel();
    }
  }, 500);
}

main();
