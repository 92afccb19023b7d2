// An editor extension tried for real against a `localllm serve`: VS Code (code-server) in a
// headless Chromium, a file opened, text typed at its end, the inline completion (ghost text)
// the extension shows read from the page, accepted with Tab, and the file saved and printed.
//
// Setup (docs/testing.md, "Editors, tried for real"): code-server running on --url with the
// extension installed and its settings pointing at the server; in the folder that holds this
// script's dependencies, `npm i @sparticuz/chromium puppeteer-core` (Chromium comes inside the
// npm package, so nothing is downloaded at run time).
//
//   node scripts/vscode_trial.mjs --url http://127.0.0.1:8090 --folder /tmp/work \
//        --file fib.js --type return --shots /tmp/shots
//
// Prints one JSON object: the ghost text seen (null if none within --wait seconds), the
// extension's status-bar items, the file after Tab, and the times. Exit 1 when no ghost text.
//
// With --chat TEXT (and --panel NAME, the extension's activity-bar item): its chat panel is
// opened instead, TEXT sent (after "@" + --mention, picked from the menu, when given), and the
// panel's text printed once the answer has stopped changing.
//
//   node scripts/vscode_trial.mjs --panel Continue --mention codebase --chat "Which function ..."

import fs from "fs";
import path from "path";
import { createRequire } from "module";

const args = Object.fromEntries(process.argv.slice(2).reduce((pairs, a, i, all) =>
  a.startsWith("--") ? [...pairs, [a.slice(2), all[i + 1]]] : pairs, []));
const url = args.url ?? "http://127.0.0.1:8090";
const folder = args.folder ?? "/tmp/work";
const file = args.file ?? "fib.js";
const typed = args.type ?? "return";
const waitS = Number(args.wait ?? 60);
const shots = args.shots;
const modules = args.modules ?? process.cwd();  // where @sparticuz/chromium and puppeteer-core are

const require = createRequire(path.join(modules, "node_modules", "x.js"));
const chromium = (await import(require.resolve("@sparticuz/chromium"))).default;
const puppeteer = (await import(require.resolve("puppeteer-core"))).default;

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const t0 = Date.now();
const seconds = () => Number(((Date.now() - t0) / 1000).toFixed(1));
const result = { file, typed, ghost: null, ghost_after_s: null, status: null, after: null, errors: [] };

const browser = await puppeteer.launch({
  executablePath: await chromium.executablePath(), headless: true,
  args: [...chromium.args, "--window-size=1400,900"], defaultViewport: { width: 1400, height: 900 },
});
try {
  // Desktop VS Code reads the clipboard freely (Continue's autocomplete does, for context); a
  // browser asks first, so grant it as a person would.
  await browser.defaultBrowserContext().overridePermissions(url, ["clipboard-read", "clipboard-write"]);
  const page = await browser.newPage();
  page.on("console", (m) => {
    const text = m.text();
    if (/error/i.test(text) && /extension host/i.test(text)) result.errors.push(text.slice(0, 300));
  });
  await page.goto(`${url}/?folder=${encodeURIComponent(folder)}`, { waitUntil: "domcontentloaded" });
  await page.waitForSelector(".monaco-workbench", { timeout: 120000 });
  await sleep(8000);  // the extension host starts the extensions
  if (args.chat) {
    await chat(page, args.panel ?? "Continue", args.mention, args.chat, waitS);
    process.exit(0);
  }
  await page.keyboard.down("Control"); await page.keyboard.press("KeyP"); await page.keyboard.up("Control");
  await sleep(1500);
  await page.keyboard.type(file, { delay: 50 });
  await sleep(1500);
  await page.keyboard.press("Enter");
  await page.waitForSelector(".monaco-editor .view-lines", { timeout: 60000 });
  await sleep(5000);
  await page.click(".monaco-editor .view-lines");
  await page.keyboard.down("Control"); await page.keyboard.press("End"); await page.keyboard.up("Control");
  await page.keyboard.type(typed, { delay: 120 });
  const typedAt = Date.now();
  result.typed_at = typedAt / 1000;  // epoch seconds, to set beside a server's or proxy's log
  while (result.ghost === null && Date.now() - typedAt < waitS * 1000) {
    await sleep(250);
    result.ghost = await page.evaluate(() => {
      const parts = [...document.querySelectorAll(".ghost-text-decoration, .ghost-text-decoration-preview, .ghost-text")];
      return parts.length ? parts.map((e) => e.textContent).join("") : null;
    });
  }
  result.ghost_after_s = result.ghost === null ? null : Number(((Date.now() - typedAt) / 1000).toFixed(1));
  if (shots) { fs.mkdirSync(shots, { recursive: true }); await page.screenshot({ path: path.join(shots, "ghost.png") }); }
  result.status = await page.evaluate(() => [...document.querySelectorAll(".statusbar-item")]
    .map((e) => e.textContent.trim()).filter((t) => t && /llama|continue|t\/s|ms\b/i.test(t)));
  if (result.ghost !== null) { await page.keyboard.press("Tab"); await sleep(1000); }
  await page.keyboard.down("Control"); await page.keyboard.press("KeyS"); await page.keyboard.up("Control");
  await sleep(2000);
  if (shots) await page.screenshot({ path: path.join(shots, "after.png") });
  result.after = fs.readFileSync(path.join(folder, file), "utf8");
} finally {
  await browser.close();
}
result.total_s = seconds();
console.log(JSON.stringify(result, null, 2));
process.exit(result.ghost === null ? 1 : 0);

async function chat(page, panel, mention, text, waitS) {
  const item = await page.$(`.activitybar [aria-label*="${panel}"]`);
  if (!item) throw new Error(`no activity-bar item named ${panel}`);
  await item.click();
  let frame = null;  // the panel's webview, nested in iframes
  for (let i = 0; i < 60 && !frame; i++) {
    await sleep(1000);
    for (const f of page.frames()) {
      try { if (await f.$('.ProseMirror, div[contenteditable="true"]')) { frame = f; break; } } catch {}
    }
  }
  if (!frame) throw new Error(`${panel}'s panel has no input box`);
  await (await frame.$('.ProseMirror, div[contenteditable="true"]')).click();
  if (mention) {
    await page.keyboard.type("@" + mention, { delay: 50 });
    await sleep(2000);
    await page.keyboard.press("Enter");
    await sleep(1000);
  }
  await page.keyboard.type(text, { delay: 20 });
  await page.keyboard.press("Enter");
  const sent = Date.now();
  let last = "", still = 0;
  while (Date.now() - sent < waitS * 1000 && (still < 4 || /Generating/.test(last))) {
    await sleep(1000);
    const now = await frame.evaluate(() => document.body.innerText);
    still = now === last ? still + 1 : 0;
    last = now;
  }
  console.log(JSON.stringify({ panel, mention: mention ?? null, sent: text, answered_in_s: (Date.now() - sent) / 1000 - still,
                               panel_text: last }, null, 2));
}
