// Shared by the node tests of `dsv3 serve`: the pinned node packages (from the cache that
// scripts/fetch_node_deps.sh fills; a missing one is an error, never a skip), a tiny synthetic
// model, and the server as a child process on a free port.
"use strict";
const { spawn, spawnSync } = require("node:child_process");
const crypto = require("node:crypto");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");

const binary = process.env.DSV3_BINARY;
if (!binary) throw new Error("DSV3_BINARY must name the dsv3 binary (ctest sets it)");

// The node_modules folder fetch_node_deps.sh made for this package-lock.json.
function nodeModules() {
  const lock = fs.readFileSync(path.join(__dirname, "package-lock.json"));
  const key = crypto.createHash("sha256").update(lock).digest("hex").slice(0, 16);
  const cache = process.env.DSV3_CACHE || path.join(os.homedir(), ".cache", "dsv3");
  const dir = path.join(cache, "node", key, "node_modules");
  if (!fs.existsSync(path.join(dir, ".dsv3-complete")))
    throw new Error(`the node packages of the tests are not installed in ${dir}: run scripts/setup.sh ` +
                    "(it runs scripts/fetch_node_deps.sh)");
  return dir;
}

function requireDep(name) {
  return require(path.join(nodeModules(), name));
}

function tokenizerDir() {
  const cache = process.env.DSV3_CACHE || path.join(os.homedir(), ".cache", "dsv3");
  const dir = process.env.DSV3_TOKENIZER_DIR || path.join(cache, "tokenizer", "deepseek-v3");
  if (!fs.existsSync(path.join(dir, "tokenizer.json")))
    throw new Error(`no tokenizer in ${dir}: run scripts/fetch_tokenizer.sh`);
  return dir;
}

// A temporary folder holding the tiny model (model/) and a tokenizer whose chat template ends
// the prompt as DeepSeek-V3.1's does: <think> when chat_template_kwargs.thinking is true.
function makeWorkspace() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "dsv3-node-"));
  const synth = spawnSync(binary, ["synth", "--shape", "tiny", "--dtype", "fp8", "--seed", "1",
                                   "--out", path.join(dir, "model")], { encoding: "utf8" });
  if (synth.status !== 0) throw new Error("dsv3 synth failed: " + synth.stderr);
  const tok = path.join(dir, "thinking-tokenizer");
  fs.mkdirSync(tok);
  fs.copyFileSync(path.join(tokenizerDir(), "tokenizer.json"), path.join(tok, "tokenizer.json"));
  fs.writeFileSync(path.join(tok, "tokenizer_config.json"), JSON.stringify({
    bos_token: "<｜begin▁of▁sentence｜>",
    eos_token: "<｜end▁of▁sentence｜>",
    chat_template: "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}" +
                   "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}" +
                   "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>" +
                   "{% if thinking is defined and thinking %}<think>\n{% else %}</think>{% endif %}{% endif %}",
  }));
  return { dir, model: path.join(dir, "model"), thinkingTokenizer: tok,
           remove: () => fs.rmSync(dir, { recursive: true, force: true }) };
}

// Starts `dsv3 serve --model <model> --port 0 <args>`; resolves to {url, stop()} once it listens.
function startServer(model, args = []) {
  return new Promise((resolve, reject) => {
    const proc = spawn(binary, ["serve", "--model", model, "--port", "0", ...args], { stdio: ["ignore", "pipe", "pipe"] });
    let log = "";
    const timer = setTimeout(() => { proc.kill("SIGKILL"); reject(new Error("dsv3 serve did not start:\n" + log)); }, 120000);
    const onData = (d) => {
      log += d.toString();
      const m = log.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\n/);
      if (m) {
        clearTimeout(timer);
        resolve({
          url: m[1],
          log: () => log,
          stop: () => new Promise((done) => {
            if (proc.exitCode !== null) return done(proc.exitCode);
            proc.once("exit", (code) => done(code));
            proc.kill("SIGTERM");
          }),
        });
      }
    };
    proc.stdout.on("data", onData);
    proc.stderr.on("data", onData);
    proc.once("exit", (code) => { clearTimeout(timer); reject(new Error(`dsv3 serve exited (${code}):\n` + log)); });
  });
}

// Runs an async test body: prints its failure and sets the exit code.
function run(name, body) {
  body().then(() => console.log(`${name}: passed`), (e) => {
    console.error(`${name}: FAILED\n${e && e.stack ? e.stack : e}`);
    process.exitCode = 1;
  });
}

module.exports = { requireDep, makeWorkspace, startServer, run };
