// `nibble serve` on the bundled model (CPU), driven by the official `openai` npm client, as users'
// tools drive vLLM: models, chat and completions with and without streaming, usage, stop strings,
// seeded sampling, greedy through the server equal to `nibble run`, 16 clients at once equal to
// one at a time, errors as the client's typed exceptions, and the API key.
// Run by tools/test: NIBBLE_BIN=build/cpu/nibble node --test tests/server/openai_client.test.mjs
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const bin = process.env.NIBBLE_BIN ?? path.join(root, "build/cpu/nibble");
const model = path.join(root, "models/nibble-tiny-coder");

// Starts `nibble serve` on a free port; resolves with the process and its base URL.
function serve(extra = []) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ["serve", model, "--port", "0", "--served-model-name", "tiny", ...extra], {
      stdio: ["ignore", "ignore", "pipe"],
    });
    let err = "";
    p.stderr.on("data", (d) => {
      err += d;
      const m = err.match(/on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) resolve({ proc: p, url: `http://127.0.0.1:${m[1]}/v1` });
    });
    p.on("exit", (code) => reject(new Error(`nibble serve exited (${code}): ${err}`)));
  });
}

let server, client;
before(async () => {
  server = await serve();
  client = new OpenAI({ baseURL: server.url, apiKey: "unused", maxRetries: 0 });
});
after(() => server.proc.kill("SIGTERM"));

const ask = (content, extra = {}) =>
  client.chat.completions.create({
    model: "tiny", messages: [{ role: "user", content }], max_tokens: 16, temperature: 0, ...extra,
  });

test("models lists the served name", async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ["tiny"]);
});

test("chat: message, usage, finish reason", async () => {
  const r = await ask("Reverse a string in Python.");
  assert.equal(r.object, "chat.completion");
  assert.equal(r.choices[0].message.role, "assistant");
  assert.ok(r.choices[0].message.content.length > 0);
  assert.equal(r.choices[0].finish_reason, "length");
  assert.equal(r.usage.completion_tokens, 16);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 16);
});

test("chat streaming adds up to the same answer, with usage at the end", async () => {
  const whole = await ask("Write a loop.");
  const stream = await ask("Write a loop.", { stream: true, stream_options: { include_usage: true } });
  let text = "", finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta.content ?? "";
      finish = c.finish_reason ?? finish;
    }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 16);
});

test("greedy through the server equals nibble run", async () => {
  const r = await ask("Reverse a string.", { max_tokens: 12 });
  const out = execFileSync(bin, ["run", "-m", model, "--chat", "Reverse a string.", "-n", "12", "--temperature", "0",
                                 "--json"], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
  const text = out.trim().split("\n").map((l) => JSON.parse(l).text).join("");
  assert.equal(r.choices[0].message.content, text);
});

test("completions, streaming and not, and stop strings", async () => {
  const r = await client.completions.create({ model: "tiny", prompt: "def fib(n):", max_tokens: 8, temperature: 0 });
  assert.equal(r.object, "text_completion");
  const s = await client.completions.create({ model: "tiny", prompt: "def fib(n):", max_tokens: 8, temperature: 0,
                                              stream: true });
  let text = "";
  for await (const chunk of s) text += chunk.choices[0]?.text ?? "";
  assert.equal(text, r.choices[0].text);
  const stopped = await client.completions.create({ model: "tiny", prompt: "def fib(n):", max_tokens: 40,
                                                    temperature: 0, stop: ["\n"] });
  assert.ok(!stopped.choices[0].text.includes("\n"));
  assert.equal(stopped.choices[0].finish_reason, "stop");
});

test("the same seed gives the same text", async () => {
  const opts = { temperature: 0.9, seed: 1234, max_tokens: 24 };
  const a = await ask("Write a class.", opts);
  const b = await ask("Write a class.", opts);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
});

// One gauge of the server's Prometheus text.
async function gauge(name) {
  const text = await (await fetch(server.url.replace(/\/v1$/, "/metrics"))).text();
  const m = text.match(new RegExp(`^${name} (\\S+)$`, "m"));
  assert.ok(m, `${name} is missing from /metrics`);
  return Number(m[1]);
}

// Half of the clients stream; the KV blocks they hold are watched while they run and must all be
// back in the pool (and nothing running) once every answer is in.
test("16 clients at once get what they get one at a time, and the KV blocks return", async () => {
  const prompts = Array.from({ length: 16 }, (_, i) => `Task ${i}: write a function.`);
  const alone = [];
  for (const p of prompts) alone.push((await ask(p)).choices[0].message.content);
  const total = await gauge("nibble_kv_cache_blocks_total");
  assert.ok(total > 0);
  let peak = 0, running = true;
  const watch = (async () => {
    while (running) {
      peak = Math.max(peak, await gauge("nibble_kv_cache_blocks_used"));
      await new Promise((r) => setTimeout(r, 5));
    }
  })();
  const streamed = async (content) => {
    const stream = await client.chat.completions.create({
      model: "tiny", messages: [{ role: "user", content }], max_tokens: 16, temperature: 0, stream: true,
    });
    let text = "";
    for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? "";
    return text;
  };
  const together = await Promise.all(
    prompts.map((p, i) => (i % 2 ? streamed(p) : ask(p).then((r) => r.choices[0].message.content))));
  running = false;
  await watch;
  assert.deepEqual(together, alone);
  assert.ok(peak > 0, "no KV blocks were seen in use while 16 clients ran");
  assert.equal(await gauge("nibble_kv_cache_blocks_used"), 0);
  assert.equal(await gauge("nibble_kv_cache_blocks_free"), total);
  assert.equal(await gauge("nibble_num_requests_running"), 0);
});

test("bad requests raise the client's typed errors", async () => {
  await assert.rejects(ask("x", { model: "no-such-model" }), (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(ask("x", { max_tokens: 0 }), (e) => e instanceof OpenAI.BadRequestError && /at least 1/.test(e.message));
  await assert.rejects(ask("x", { max_tokens: 10_000_000 }), (e) => e.status === 400 && /context length/.test(e.message));
  await assert.rejects(ask("x".repeat(20000)), (e) => e.status === 400 && /context length/.test(e.message));
  await assert.rejects(ask("x", { temperature: -1 }), (e) => e.status === 400 && e.param === "temperature");
});

test("with --api-key, a request without the key gets 401", async () => {
  const s = await serve(["--api-key", "sekrit"]);
  try {
    const bad = new OpenAI({ baseURL: s.url, apiKey: "wrong", maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError);
    const good = new OpenAI({ baseURL: s.url, apiKey: "sekrit", maxRetries: 0 });
    assert.equal((await good.models.list()).data[0].id, "tiny");
  } finally {
    s.proc.kill("SIGTERM");
  }
});
