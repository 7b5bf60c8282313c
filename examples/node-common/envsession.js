// The simulator's side of kuberl's Actor.EnvSession stream, shared by the Node.js examples
// (node-cartpole: Discrete actions; node-pendulum: a continuous Box action; node-masked-choice:
// MultiDiscrete actions under per-step action masks).
//
// An example supplies its environment (N copies stepped in lockstep) and its spaces; this module
// speaks the protocol: hello, step 0, then one EnvStep per ActionReply, same-step resets with the
// true last observations in final_observations, planned handovers to a new stream every
// --reconnect-every seconds (the actor resumes the session), progress lines, a final JSON line.
// The protocol is documented in protos/kuberl/v1/actor.proto and docs/external-simulators.md.
//
// A simulator of several agents (hello.agent_ids: examples/node-crossing) builds each step with
// agentsStep, which also says when no agent acts (EnvStep.no_agents).
//
// This module requires no package itself: each example passes in the @grpc/grpc-js and
// @grpc/proto-loader it installed (`deps`), so the module lives outside any example's node_modules.
'use strict';

const path = require('path');

// kuberl.v1.DType (protos/kuberl/v1/common.proto)
const DTYPE_INT64 = 5;
const DTYPE_FLOAT32 = 7;
const DTYPE_BOOL = 9;

// A Tensor is dtype + int64 shape + raw little-endian row-major bytes. Typed arrays use the
// platform's byte order, so their bytes go on the wire as they are on little-endian machines
// (x86-64, arm64); a big-endian one would have to swap them (a DataView with littleEndian = true).
if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
  throw new Error('these examples assume a little-endian platform (tensors are little-endian on the wire)');
}

function tensor(dtype, shape, typedArray) {
  return {
    dtype,
    shape,
    data: Buffer.from(typedArray.buffer, typedArray.byteOffset, typedArray.byteLength),
  };
}

function checkShape(t, want, itemsize) {
  const shape = t.shape.map(Number);
  if (shape.length !== want.length || shape.some((d, k) => d !== want[k])) {
    throw new Error(`ActionReply.actions: shape [${shape}], expected [${want}]`);
  }
  const bytes = want.reduce((a, b) => a * b, 1) * itemsize;
  if (t.data.length !== bytes) throw new Error(`ActionReply.actions: ${t.data.length} bytes, expected ${bytes}`);
}

// ActionReply.actions for Discrete(n): [num_envs] int64. One Number per env; throws if malformed.
function decodeDiscrete(t, numEnvs, numActions) {
  if (!t) throw new Error('ActionReply.actions is missing');
  if (t.dtype !== DTYPE_INT64) throw new Error(`ActionReply.actions: dtype ${t.dtype}, expected DTYPE_INT64 (5)`);
  checkShape(t, [numEnvs], 8);
  const actions = new Array(numEnvs);
  for (let i = 0; i < numEnvs; i++) {
    const a = t.data.readBigInt64LE(i * 8);
    if (a < 0n || a >= BigInt(numActions)) throw new Error(`ActionReply.actions[${i}] = ${a}, expected 0..${numActions - 1}`);
    actions[i] = Number(a);
  }
  return actions;
}

// ActionReply.actions for a Box of `size` elements: [num_envs, size] float32, already clipped to
// [low, high] by the actor. One Float32Array(size) per env; clipped again here (defensive: a
// simulator should never trust its input), NaN refused.
function decodeBox(t, numEnvs, size, low, high) {
  if (!t) throw new Error('ActionReply.actions is missing');
  if (t.dtype !== DTYPE_FLOAT32) throw new Error(`ActionReply.actions: dtype ${t.dtype}, expected DTYPE_FLOAT32 (7)`);
  checkShape(t, [numEnvs, size], 4);
  const actions = new Array(numEnvs);
  for (let i = 0; i < numEnvs; i++) {
    const a = new Float32Array(size);
    for (let k = 0; k < size; k++) {
      const v = t.data.readFloatLE((i * size + k) * 4);
      if (Number.isNaN(v)) throw new Error(`ActionReply.actions[${i}][${k}] is NaN`);
      a[k] = Math.min(high, Math.max(low, v));
    }
    actions[i] = a;
  }
  return actions;
}

// ActionReply.actions for MultiDiscrete(nvec): [num_envs, len(nvec)] int64, choice k in 0..nvec[k]-1.
// One Int32Array(len(nvec)) per env; throws if malformed.
function decodeMultiDiscrete(t, numEnvs, nvec) {
  if (!t) throw new Error('ActionReply.actions is missing');
  if (t.dtype !== DTYPE_INT64) throw new Error(`ActionReply.actions: dtype ${t.dtype}, expected DTYPE_INT64 (5)`);
  const k = nvec.length;
  checkShape(t, [numEnvs, k], 8);
  const actions = new Array(numEnvs);
  for (let i = 0; i < numEnvs; i++) {
    const a = new Int32Array(k);
    for (let c = 0; c < k; c++) {
      const v = t.data.readBigInt64LE((i * k + c) * 8);
      if (v < 0n || v >= BigInt(nvec[c])) throw new Error(`ActionReply.actions[${i}][${c}] = ${v}, expected 0..${nvec[c] - 1}`);
      a[c] = Number(v);
    }
    actions[i] = a;
  }
  return actions;
}

// The EnvStep of a session of several agents (docs/multi-agent.md, "Agents over EnvSession"):
//   agents        the ids acting on this step, in row order ([]: no agent acts);
//   observations  one array (or Float32Array) of obsDim numbers per agent of `agents`, in that order;
//   outcomes      one { reward, terminated, truncated, final } per agent that acted on the step before,
//                 in that step's order (final: its true last observation, where it ended); null or []
//                 on step 0 and after a step of no agents (there are no outcomes then);
//   joined        ids back after their episode ended and they left (never an agent's first step).
// No agent acting is sent as no_agents = true, never as an empty `agents` (which means every agent,
// in hello order); the reply's actions then have 0 rows (decodeDiscrete(t, 0, n) is []). Every agent
// that acted and did not end must be in `agents` (the actor refuses the step otherwise).
function agentsStep(stepId, agents, observations, obsDim, outcomes = null, joined = []) {
  if (observations.length !== agents.length) {
    throw new Error(`agentsStep: ${observations.length} observations for ${agents.length} agents`);
  }
  const rows = (xs) => {
    const flat = new Float32Array(xs.length * obsDim);
    xs.forEach((row, k) => {
      if (row.length !== obsDim) throw new Error(`agentsStep: an observation of ${row.length} numbers, not ${obsDim}`);
      flat.set(row, k * obsDim);
    });
    return tensor(DTYPE_FLOAT32, [xs.length, obsDim], flat);
  };
  const step = { step_id: stepId, agents, joined, no_agents: agents.length === 0 };
  if (agents.length) step.observations = rows(observations);
  if (outcomes && outcomes.length) {
    const n = outcomes.length;
    step.rewards = tensor(DTYPE_FLOAT32, [n], Float32Array.from(outcomes, (o) => o.reward));
    step.terminated = tensor(DTYPE_BOOL, [n], Uint8Array.from(outcomes, (o) => (o.terminated ? 1 : 0)));
    step.truncated = tensor(DTYPE_BOOL, [n], Uint8Array.from(outcomes, (o) => (o.truncated ? 1 : 0)));
    const ended = outcomes.filter((o) => o.terminated || o.truncated);
    if (ended.some((o) => !o.final)) throw new Error('agentsStep: an agent that ended needs its final observation');
    if (ended.length) step.final_observations = rows(ended.map((o) => o.final));
  }
  return step;
}

// mulberry32: a small seeded PRNG, so a run is reproducible with --seed.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// ---- command line --------------------------------------------------------------------------------

function usage(script, message) {
  if (message) console.error(`${script}: ${message}`);
  const out = message ? console.error : console.log;
  out(`usage: node ${script} --actor HOST:PORT [--envs N] [--steps S] [--session ID] [--seed K]\n` +
    '  --actor HOST:PORT     the kuberl actor (env.mode: external) to connect to (required)\n' +
    '  --envs N              env copies stepped in lockstep, 1..1024 (default 16)\n' +
    '  --steps S             lockstep steps before half-closing and exiting 0 (default: run until Ctrl-C)\n' +
    '  --session ID          session id; reconnecting with the same id resumes (default <example>-<pid>)\n' +
    '  --seed K              seed of the initial states (default 0)\n' +
    '  --connect-timeout S   seconds to wait for the actor to accept connections (default 60)\n' +
    '  --report-every S      seconds between progress lines (default 5)\n' +
    '  --reply-timeout S     give up (exit 1) when the actor sends nothing for this long (default 300)\n' +
    '  --reconnect-every S   hand the session over to a new stream (and connection) this often; the actor\n' +
    '                        resumes it, nothing is lost (default 240; 0 = never: the actor\'s server ends\n' +
    '                        connections after about 5 min + 30 s grace, which ends a longer stream)\n' +
    'TLS (an actor with tls.enabled; docs/security.md), from the environment; none set: plaintext:\n' +
    '  KUBERL_TLS_CA           PEM CA bundle that verifies the actor (unset: the system\'s CAs)\n' +
    '  KUBERL_TLS_CERT, _KEY   PEM client certificate and key (when the actor requires one)\n' +
    '  KUBERL_TLS_SERVER_NAME  the name checked in the actor\'s certificate instead of the host\n' +
    'Tokens (an actor with auth.token_files; docs/security.md), from the environment:\n' +
    '  KUBERL_TOKEN            sent as "authorization: Bearer <token>" (without TLS: sent, with a warning)\n' +
    '  KUBERL_TOKEN_FILE       a file whose first token is sent (read again at every reconnect)');
  process.exit(message ? 2 : 0);
}

function parseArgs(script, name, argv) {
  const opts = {
    actor: null, envs: 16, steps: Infinity, session: `${name}-${process.pid}`, seed: 0,
    connectTimeout: 60, reportEvery: 5, replyTimeout: 300, reconnectEvery: 240,
  };
  const names = { '--actor': 'actor', '--envs': 'envs', '--steps': 'steps', '--session': 'session', '--seed': 'seed',
    '--connect-timeout': 'connectTimeout', '--report-every': 'reportEvery', '--reply-timeout': 'replyTimeout',
    '--reconnect-every': 'reconnectEvery' };
  for (let i = 0; i < argv.length; i++) {
    let arg = argv[i];
    let value;
    if (arg === '-h' || arg === '--help') usage(script);
    const eq = arg.indexOf('=');
    if (eq > 0) { value = arg.slice(eq + 1); arg = arg.slice(0, eq); }
    const key = names[arg];
    if (!key) usage(script, `unknown argument ${arg}`);
    if (value === undefined) {
      if (i + 1 >= argv.length) usage(script, `${arg} needs a value`);
      value = argv[++i];
    }
    opts[key] = value;
  }
  if (!opts.actor) usage(script, '--actor HOST:PORT is required');
  for (const [key, min, max] of [['envs', 1, 1024], ['seed', 0, 2 ** 32 - 1]]) {
    const v = Number(opts[key]);
    if (!Number.isInteger(v) || v < min || v > max) usage(script, `--${key} must be an integer in ${min}..${max}`);
    opts[key] = v;
  }
  if (opts.steps !== Infinity) {
    opts.steps = Number(opts.steps);
    if (!Number.isInteger(opts.steps) || opts.steps < 1) usage(script, '--steps must be a positive integer');
  }
  opts.reconnectEvery = Number(opts.reconnectEvery);
  if (!(opts.reconnectEvery >= 0)) usage(script, '--reconnect-every must be >= 0 (0 = never)');
  for (const key of ['connectTimeout', 'reportEvery', 'replyTimeout']) {
    opts[key] = Number(opts[key]);
    if (!(opts[key] > 0)) usage(script, `--${key.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)} must be > 0`);
  }
  if (opts.session.length < 1 || opts.session.length > 128) usage(script, '--session must be 1..128 characters');
  return opts;
}

// TLS to the actor, from the environment (see usage): { credentials, options } for a client.
function channelSecurity(grpc, script) {
  const fs = require('fs');
  const { KUBERL_TLS_CA: ca, KUBERL_TLS_CERT: cert, KUBERL_TLS_KEY: key, KUBERL_TLS_SERVER_NAME: serverName } = process.env;
  if (!ca && !cert && !key && !serverName) {
    return { credentials: grpc.credentials.createInsecure(), options: {}, secure: false };
  }
  if (!cert !== !key) usage(script, 'KUBERL_TLS_CERT and KUBERL_TLS_KEY: a client certificate needs its key (set both)');
  const read = (name, file) => {
    try {
      return fs.readFileSync(file);
    } catch (e) {
      return usage(script, `${name}: cannot read ${file}: ${e.message}`);
    }
  };
  return {
    credentials: grpc.credentials.createSsl(ca ? read('KUBERL_TLS_CA', ca) : null,
      key ? read('KUBERL_TLS_KEY', key) : null, cert ? read('KUBERL_TLS_CERT', cert) : null),
    options: serverName ? { 'grpc.ssl_target_name_override': serverName } : {},
    secure: true,
  };
}

// The bearer token metadata for EnvSession, from $KUBERL_TOKEN or the first token of $KUBERL_TOKEN_FILE
// (read at every call, so a rotated token is picked up at the next reconnect); empty without either.
let warnedPlaintext = false;
function tokenMetadata(grpc, script, secure) {
  const metadata = new grpc.Metadata();
  let token = process.env.KUBERL_TOKEN || '';
  const file = process.env.KUBERL_TOKEN_FILE;
  if (!token && file) {
    let text;
    try {
      text = require('fs').readFileSync(file, 'utf8');
    } catch (e) {
      return usage(script, `KUBERL_TOKEN_FILE: cannot read ${file}: ${e.message}`);
    }
    const line = text.split('\n').map((l) => l.split('#')[0].trim()).find((l) => l);
    if (!line) usage(script, `KUBERL_TOKEN_FILE: ${file} holds no token`);
    token = line.split(/\s+/)[0];
  }
  if (!token) return metadata;
  if (!secure && !warnedPlaintext) {
    warnedPlaintext = true;
    process.stderr.write('warning: sending a bearer token without TLS: anyone on the path can read it\n');
  }
  metadata.set('authorization', `Bearer ${token.trim()}`);
  return metadata;
}

// ---- the session ---------------------------------------------------------------------------------

function mean(xs) {
  return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
}

// Runs one simulator until --steps lockstep steps (or Ctrl-C), then exits the process: 0 after the
// final JSON line, 1 with the gRPC status (or protocol error) on stderr.
//
// deps: { grpc, protoLoader } (the example's own @grpc/grpc-js and @grpc/proto-loader).
// sim: { name, script, observationSpace, actionSpace (EnvHello Space messages), obsDim,
//        make(numEnvs, seed) -> envs with observations() -> Float32Array [N * obsDim],
//          observe(i, out, row), stepOne(i, action) -> [reward, terminated, truncated], reset(i),
//          and optionally masks() -> Uint8Array [N * maskWidth], the actions allowed at observations(),
//        maskWidth (with masks: n for Discrete, sum(nvec) for MultiDiscrete),
//        decodeActions(tensor, numEnvs) -> one action per env (throws if malformed) }
function runSimulator(deps, sim) {
  const { grpc, protoLoader } = deps;
  const packageDefinition = protoLoader.loadSync('kuberl/v1/actor.proto', {
    includeDirs: [path.resolve(__dirname, '../../protos')], // so `import "kuberl/v1/common.proto"` resolves
    keepCase: true, // field names exactly as in the .proto: step_id, final_observations, ...
    longs: Number, // every 64-bit integer (step_id, shape, policy_version) as a JS number, both ways
    enums: Number, // DType as its number (DTYPE_FLOAT32 = 7, ...), both ways
    defaults: true, // unset scalars read as 0 / "" / empty, unset messages as null
    oneofs: true, // EnvMessage.kind / ActorMessage.kind name the field that is set
  });
  const kuberl = grpc.loadPackageDefinition(packageDefinition).kuberl.v1;
  const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

  const opts = parseArgs(sim.script, sim.name, process.argv.slice(2));
  const security = channelSecurity(grpc, sim.script);
  const N = opts.envs;
  const OBS_DIM = sim.obsDim;
  const envs = sim.make(N, opts.seed);
  const episodeReturn = new Float64Array(N);
  const firstReturns = []; // the first 100 episodes
  let lastReturns = []; // the last (up to) 100 episodes
  let best100 = null; // the best mean over 100 consecutive episodes so far (null before 100 episodes)
  let episodes = 0;
  let steps = 0; // lockstep steps applied (actions received and stepped), over every stream
  let sessions = 0; // streams opened (1 + planned handovers)
  let resumed = 0; // streams the actor accepted as a resume
  let policyVersion = null;
  let firstPolicyVersion = null;
  let stopRequested = false;
  let failed = false;
  let client = null; // the current stream's client (one connection each)
  let call = null;
  let timer = null;
  let lastHeard = 0;
  const started = process.hrtime.bigint();
  const elapsed = () => Number(process.hrtime.bigint() - started) / 1e9;

  function fail(what, err) {
    if (failed) return; // the first error is the one that counts (e.g. not the CANCELLED that follows it)
    failed = true;
    clearInterval(timer);
    const line = err && err.code !== undefined
      ? `${what}: gRPC status ${STATUS_NAMES[err.code] || err.code} (${err.code}): ${err.details}`
      : `${what}: ${err && err.message ? err.message : err}`;
    process.stderr.write(`${line}\n`, () => process.exit(1));
  }

  // EnvStep.action_masks for the observations about to be sent (only for envs that have masks).
  function withMasks(step) {
    if (envs.masks) step.action_masks = tensor(DTYPE_BOOL, [N, sim.maskWidth], envs.masks());
    return step;
  }

  // EnvStep 0 of a stream: the current observation of every copy (and their masks), nothing else.
  function firstStep() {
    return withMasks({ step_id: 0, observations: tensor(DTYPE_FLOAT32, [N, OBS_DIM], envs.observations()) });
  }

  // Applies one action per copy; returns the EnvStep (without step_id) that reports the outcome.
  function applyActions(actions) {
    const rewards = new Float32Array(N);
    const terminated = new Uint8Array(N); // bool tensors: one byte per element, 0 or 1
    const truncated = new Uint8Array(N);
    const finals = []; // env indices whose episode ended, in env order
    for (let i = 0; i < N; i++) {
      const [reward, term, trunc] = envs.stepOne(i, actions[i]);
      rewards[i] = reward;
      terminated[i] = term ? 1 : 0;
      truncated[i] = trunc ? 1 : 0;
      episodeReturn[i] += reward;
      if (term || trunc) finals.push(i);
    }
    let finalObservations;
    if (finals.length) {
      // The true last observation of each ended copy, captured before the same-step reset.
      const fin = new Float32Array(finals.length * OBS_DIM);
      finals.forEach((env, k) => envs.observe(env, fin, k));
      finalObservations = tensor(DTYPE_FLOAT32, [finals.length, OBS_DIM], fin);
      for (const env of finals) {
        const ret = episodeReturn[env];
        if (firstReturns.length < 100) firstReturns.push(ret);
        lastReturns.push(ret);
        if (lastReturns.length > 200) lastReturns = lastReturns.slice(-100);
        episodes += 1;
        if (episodes >= 100) best100 = Math.max(best100 ?? -Infinity, lastMean());
        episodeReturn[env] = 0;
        envs.reset(env);
      }
    }
    steps += 1;
    const step = {
      observations: tensor(DTYPE_FLOAT32, [N, OBS_DIM], envs.observations()), // reset ones for ended copies
      rewards: tensor(DTYPE_FLOAT32, [N], rewards),
      terminated: tensor(DTYPE_BOOL, [N], terminated),
      truncated: tensor(DTYPE_BOOL, [N], truncated),
    };
    if (finalObservations) step.final_observations = finalObservations; // absent when no copy ended
    return withMasks(step);
  }

  function lastMean() {
    return mean(lastReturns.slice(-100));
  }

  function report() {
    const t = elapsed();
    const m = lastMean();
    console.log(`[${t.toFixed(1).padStart(7)}s] steps ${steps.toLocaleString('en-US')} ` +
      `(${Math.round(steps / t).toLocaleString('en-US')}/s, ${Math.round((steps * N) / t).toLocaleString('en-US')} ` +
      `env steps/s) | episodes ${episodes.toLocaleString('en-US')} | return ` +
      `${m === null ? '-' : m.toFixed(1)} (last ${Math.min(lastReturns.length, 100)}) | policy v${policyVersion ?? '-'}`);
  }

  function summary() {
    const t = elapsed();
    return {
      steps,
      env_steps: steps * N,
      envs: N,
      episodes,
      mean_return_first_100: mean(firstReturns),
      mean_return_last_100: lastMean(),
      mean_return_best_100: best100,
      policy_version_first: firstPolicyVersion,
      policy_version_last: policyVersion,
      sessions,
      resumed,
      wall_s: Number(t.toFixed(3)),
      steps_per_s: Number((steps / t).toFixed(1)),
      env_steps_per_s: Number(((steps * N) / t).toFixed(1)),
    };
  }

  function finish() {
    clearInterval(timer);
    report();
    client.close();
    process.stdout.write(`${JSON.stringify(summary())}\n`, () => process.exit(0));
  }

  // One EnvSession stream. Every stream of this process uses the same session_id: the first opens the
  // session, the later ones (planned handovers, every --reconnect-every seconds) resume it. Each gets
  // its own client, hence its own connection: the actor's server closes connections after a maximum
  // age (5 min, then 30 s grace), so a stream must not outlive the connection it started on.
  function openStream() {
    sessions += 1;
    client = new kuberl.Actor(opts.actor, security.credentials, {
      ...security.options,
      'grpc.max_receive_message_length': 64 * 1024 * 1024,
      'grpc.max_send_message_length': 64 * 1024 * 1024,
      'grpc.use_local_subchannel_pool': 1, // a new connection, not one shared with the previous stream
    });
    const myClient = client;
    const stream = client.EnvSession(tokenMetadata(grpc, sim.script, security.secure));
    call = stream;
    const openedAt = elapsed();
    let nextStepId = 0; // step_id of the next EnvStep to send on this stream
    let accepted = false;
    let closing = null; // null, or why we half-closed: 'done' (last step sent) or 'handover'
    lastHeard = elapsed();

    function send(step) {
      stream.write({ step: { step_id: nextStepId, ...step } });
      nextStepId += 1;
    }

    // 1. hello: our spaces (they must equal the actor's policy) and how many copies we step.
    stream.write({
      hello: {
        session_id: opts.session,
        observation_space: sim.observationSpace,
        action_space: sim.actionSpace,
        num_envs: N,
        simulator: sim.name,
      },
    });

    stream.on('data', (msg) => {
      lastHeard = elapsed();
      try {
        if (msg.kind === 'accepted') {
          // 2. accepted: the session is on. 3. step 0: the observations to act on.
          const a = msg.accepted;
          if (accepted) throw new Error('a second SessionAccepted');
          accepted = true;
          if (a.resumed) resumed += 1;
          policyVersion = Number(a.policy_version);
          if (sessions === 1) {
            console.log(`session ${a.session_id} accepted by ${opts.actor}${a.resumed ? ' (resumed)' : ''}: ` +
              `${N} envs, policy v${policyVersion}, session timeout ${a.session_timeout_ms} ms`);
          } else if (!a.resumed) {
            // E.g. a different (or restarted) actor behind the address: its reported returns restart.
            console.error(`warning: the actor did not resume session ${a.session_id} after a handover`);
          }
          send(firstStep());
        } else if (msg.kind === 'actions') {
          // 4. actions for the step we sent.
          const reply = msg.actions;
          if (closing) return; // the answer to the last step, sent after we half-closed: nothing to do
          if (!accepted || Number(reply.step_id) !== nextStepId - 1) {
            throw new Error(`ActionReply.step_id ${reply.step_id}, expected ${nextStepId - 1}`);
          }
          const actions = sim.decodeActions(reply.actions, N);
          policyVersion = Number(reply.policy_version);
          if (firstPolicyVersion === null) firstPolicyVersion = policyVersion;
          if (!stopRequested && opts.reconnectEvery > 0 && elapsed() - openedAt >= opts.reconnectEvery) {
            // A planned handover, lossless: half-close *before* applying these actions (the actor
            // drops them and bootstraps the last transition); the next stream resumes the session
            // and starts again at step 0 with the same observations.
            closing = 'handover';
            stream.end();
            return;
          }
          // 5. apply them and report the outcome as the next step (also after the last one, so that
          // its rewards are not lost), then half-close when done.
          send(applyActions(actions));
          if (steps >= opts.steps || stopRequested) {
            closing = 'done';
            stream.end(); // half-close: the actor flushes this session's fragment and ends the stream
          }
        } else {
          throw new Error(`unexpected ActorMessage ${JSON.stringify(msg)}`);
        }
      } catch (e) {
        fail('protocol error', e);
        stream.cancel();
      }
    });
    stream.on('error', (err) => {
      if (!failed && steps > 0) report();
      fail('EnvSession failed', err);
    });
    stream.on('status', (status) => {
      if (status.code !== grpc.status.OK) return; // reported by 'error'
      if (closing === 'done') return finish();
      if (closing === 'handover') {
        // The actor has closed (and parked) the session: only now may the same session_id say hello again.
        myClient.close();
        return openStream();
      }
      return fail('EnvSession', new Error('the actor ended the session before the simulator half-closed'));
    });
  }

  const probe = new kuberl.Actor(opts.actor, security.credentials, security.options);
  const deadline = new Date(Date.now() + opts.connectTimeout * 1000);
  probe.waitForReady(deadline, (err) => {
    probe.close();
    if (err) return fail(`cannot connect to the actor at ${opts.actor} within ${opts.connectTimeout} s`, err);
    let lastReport = elapsed();
    timer = setInterval(() => {
      const t = elapsed();
      if (t - lastReport >= opts.reportEvery) { report(); lastReport = t; }
      if (t - lastHeard > opts.replyTimeout) {
        fail('EnvSession', new Error(`no answer from the actor for ${opts.replyTimeout} s`));
        call.cancel();
      }
    }, 250);
    openStream();
  });

  process.on('SIGINT', () => {
    if (stopRequested || !call) process.exit(130);
    stopRequested = true; // finish the current step, half-close, print the summary
    console.error('interrupted: half-closing after this step (Ctrl-C again to quit at once)');
  });
}

module.exports = {
  DTYPE_BOOL, DTYPE_FLOAT32, DTYPE_INT64, agentsStep, decodeBox, decodeDiscrete, decodeMultiDiscrete, rng, runSimulator,
  tensor,
};
