// The page's behaviour: classify photos through POST /predict, compare models, and show GET /stats.
// Plain browser JavaScript, no build step. Every URL is relative to the page, so it works under a prefix.
"use strict";

const STATS_EVERY_MS = 1500;
const STATS_WINDOW_S = 60;  // GET /stats's window once the server has run that long (mnv3.stats.WINDOW_S)
const SPARK_POINTS = 40;
const DOWNSCALE_SHORT_SIDE = 512;  // twice the server's 256 px resize: no detail the model could use is lost
const DOWNSCALE_QUALITY = 0.92;
const UPLOADS_AT_ONCE = 8;  // enough for the server to batch them, few enough not to crowd out other clients
const KEY_STORAGE = "mnv3-api-key";  // in sessionStorage: this tab only, forgotten when it closes
// What a key can hold (mnv3.auth): visible ASCII. A header can carry nothing else, so fetch would throw on a key
// pasted with typographic quotes.
const KEY_CHARACTERS = /^[\x21-\x7e]+$/;
const RETRIED_STATUSES = [429, 503];  // over a key's rate, server busy: both say when to come back
const BUSY_RETRIES = 3;  // a 503'd upload is sent again this often, after its Retry-After
// A 429'd upload is sent again after each Retry-After for up to this long: the page's own uploads share the key's
// rate, so several photos chosen at once take turns (six at 30/min: ten seconds), which a count of tries would cut.
const RATE_TURNS_MAX_S = 60;
const RETRY_AFTER_MAX_S = 10;  // a longer Retry-After is said, not waited for
// The file is not an image the server reads: sent again as it is, it is refused again. Unless the browser shows it
// (a HEIC in Safari, an AVIF): "Shrink large photos" then sends it as a JPEG.
const RESENDING_CANNOT_HELP = [400, 415];
const RETRY_SPREAD = 0.5;  // up to half the wait again, at random: uploads refused together do not return together
const MODELS_RETRY_S = 5;  // GET /models failed (server down, rate limit): asked again after this
const STAND_IN_WEIGHTS = "random-init";  // GET /model's weights for stage 1's seeded stand-in (mnv3.artifacts)

const $ = (id) => document.getElementById(id);

const server = {
  models: [],  // GET /models's list, the default first: {name, default, model, backend, batching, cache, limits, ...}
  defaultModel: null,
};
// Compare mode: per model, photos whose top-1 is the default's, for the models `served` (default first).
const agreement = {served: null, photos: 0, sameTop1: {}};
const rpsHistory = [];
let statsFailed = false;  // the last GET /stats failed: the server may have restarted with other models
// A rate-limited key's requests a second, from the last answer's RateLimit-Policy field (mnv3.auth: q requests
// each w seconds), or null for a key without a rate (or no key).
let keyRatePerS = null;
const STATS_SHARE_OF_RATE = 0.25;  // the live panel spends at most this much of a rate-limited key's rate

// ----------------------------------------------------------------------------------------- formatting

function formatMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms >= 100) return `${Math.round(ms)} ms`;
  return ms >= 1 ? `${ms.toFixed(1)} ms` : `${ms.toFixed(2)} ms`;
}

function formatPercent(probability) {
  // Three significant digits below 10%: a random-init stand-in model's near-uniform top 5 still differ.
  const percent = 100 * probability;
  if (percent >= 99.95 && probability < 1) return ">99.9%";  // toFixed would round it to a certain 100.0%
  if (percent >= 10) return `${percent.toFixed(1)}%`;
  return percent >= 0.001 ? `${percent.toPrecision(3)}%` : "<0.001%";
}

function formatBytes(bytes) {
  if (bytes >= 1024 * 1024) return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
  return bytes >= 1024 ? `${Math.round(bytes / 1024)} KiB` : `${bytes} B`;
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "className") node.className = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

function definitions(className, pairs) {
  return element("dl", {className}, ...pairs.map(([term, value]) =>
    element("div", {}, element("dt", {}, term), element("dd", {}, value))));
}

// ------------------------------------------------------------------------------------------- API key

let keyEntered = null;  // while the key form is shown: the promise every refused call waits on

// Every API call goes through here. It sends the key this tab was given, if any; on a 401 (the server
// wants a key, or not that one), or a 403 for a key whose scope does not cover the page's own calls (a
// metrics key), it shows the key form and, once a key is entered, sends the call again. `ownCall` false: a
// 403 is the answer to show (the metrics link with an infer key). `options`: fetch's, and see send().
async function api(url, options = {}, ownCall = true) {
  for (;;) {
    const key = sessionStorage.getItem(KEY_STORAGE);
    const response = await send(url, key ? {...options, headers: {Authorization: `Bearer ${key}`}} : options);
    const outOfScope = ownCall && response.status === 403 &&
      /insufficient_scope/.test(response.headers.get("WWW-Authenticate") || "");
    if (response.status !== 401 && !outOfScope) {
      if (response.ok || response.status === 429) noteKeyRate(response);  // a 403 says nothing of the key's rate
      return response;
    }
    // Sent with a key the tab has replaced meanwhile (a slow upload refused after the new key was entered): the
    // new key has not been refused, so it is tried before anyone is asked again.
    if (sessionStorage.getItem(KEY_STORAGE) !== key) continue;
    // Photos sent meanwhile wait for the key too: say so on their cards, then what they said before (an upload
    // starts again: not how far it had gone).
    for (const pending of document.querySelectorAll("#photos .pending")) {
      pending.dataset.before ??= pending.textContent.startsWith("Uploading") ? "Uploading…" : pending.textContent;
      pending.textContent = "Waiting for an API key…";
    }
    await Promise.race([  // a photo cancelled meanwhile frees its turn, key or no key
      askForKey(outOfScope ? "This tab's API key may not use the page (a key of scope infer or admin may): " +
                             "enter another."
                : key ? "The server did not accept this tab's API key: enter another."
                : "This server needs an API key.", outOfScope || Boolean(key)),
      sleep(Infinity, options.signal),
    ]);
    for (const pending of document.querySelectorAll("#photos .pending[data-before]")) {
      pending.textContent = pending.dataset.before;
      delete pending.dataset.before;
    }
  }
}

// fetch, or with `onUploadProgress(sentBytes, totalBytes)` an XMLHttpRequest: only it tells how much of a body
// has gone, and a phone photo over a slow link takes many seconds. Either way a Response, or fetch's errors: a
// TypeError when the server cannot be reached, an AbortError when `signal` aborts.
function send(url, {onUploadProgress, ...options}) {
  if (!onUploadProgress) return fetch(url, options);
  const {method = "GET", headers = {}, body = null, signal} = options;
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(new DOMException("cancelled", "AbortError"));
      return;
    }
    const xhr = new XMLHttpRequest();
    xhr.open(method, url);
    for (const [name, value] of Object.entries(headers)) xhr.setRequestHeader(name, value);
    xhr.responseType = "blob";
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onUploadProgress(event.loaded, event.total);
    });
    const cancel = () => xhr.abort();
    const settle = (outcome, value) => {
      signal?.removeEventListener("abort", cancel);
      outcome(value);
    };
    xhr.addEventListener("load", () => {
      const fields = xhr.getAllResponseHeaders().trim().split(/\r\n/).filter(Boolean)
        .map((line) => [line.slice(0, line.indexOf(":")), line.slice(line.indexOf(":") + 1).trim()]);
      try {  // 204, 205 and 304 carry no body, and a status outside 200-599 none that Response takes
        const body = [204, 205, 304].includes(xhr.status) ? null : xhr.response;
        settle(resolve, new Response(body, {status: xhr.status, statusText: xhr.statusText, headers: fields}));
      } catch {
        settle(reject, new RangeError(`the server answered status ${xhr.status}, which is not HTTP's`));
      }
    });
    xhr.addEventListener("error", () => settle(reject, new TypeError("network error")));
    xhr.addEventListener("abort", () => settle(reject, new DOMException("cancelled", "AbortError")));
    signal?.addEventListener("abort", cancel, {once: true});
    xhr.send(body);
  });
}

function noteKeyRate(response) {
  const policy = /;q=(\d+);w=(\d+)/.exec(response.headers.get("RateLimit-Policy"));
  keyRatePerS = policy ? policy[1] / policy[2] : null;
}

// How long the live panel waits before asking for GET /stats again: its refresh interval, or longer for a
// rate-limited key, whose rate is the photos' first (a 30/min key would otherwise go on the panel alone).
function statsDelayMs() {
  if (!keyRatePerS) return STATS_EVERY_MS;
  // At most an hour: a browser fires a longer timeout at once
  return Math.min(3_600_000, Math.max(STATS_EVERY_MS, 1000 / (STATS_SHARE_OF_RATE * keyRatePerS)));
}

// Sets a live region's text so that the same words are announced again: cleared first, then set a moment later.
function say(region, text) {
  region.textContent = "";
  setTimeout(() => { region.textContent = text; }, 50);
}

// The status line (#announce) says one message at a time, each left for a moment before the next: two set in the
// same instant (two photos answered by one batch) would leave only the last, and words set again unchanged (a
// retry's) may not be said again. A message waiting its turn is replaced by a newer one about the same thing
// (`about`: a photo's name, or "batch"), so a photo's steps never queue up behind each other: only its latest is said.
const ANNOUNCE_GAP_MS = 500;
const announcements = [];  // [about, text], in turn
let announcing = false;

function announce(text, about = text) {
  const waiting = announcements.find(([subject]) => subject === about);
  if (waiting) waiting[1] = text;
  else announcements.push([about, text]);
  if (!announcing) nextAnnouncement();
}

function nextAnnouncement() {
  announcing = announcements.length > 0;
  if (!announcing) return;
  say($("announce"), announcements.shift()[1]);
  setTimeout(nextAnnouncement, ANNOUNCE_GAP_MS);
}

// `refused`: the tab's key was (its field is then marked invalid), not only none given yet.
function askForKey(reason, refused) {
  if (!keyEntered) {
    const form = $("key-form");
    // Set as the form appears (it was emptied as it went), so the field's description is there as it takes focus.
    $("key-reason").textContent = reason;
    const focused = document.activeElement;
    $("key-input").setAttribute("aria-invalid", String(refused));
    form.hidden = false;
    $("key-input").focus();
    keyEntered = new Promise((resolve) => {
      const submitted = (event) => {
        event.preventDefault();
        const key = $("key-input").value.trim();
        if (!KEY_CHARACTERS.test(key)) {
          $("key-input").setAttribute("aria-invalid", "true");
          say($("key-reason"), "That is not an API key: a key is letters, digits and ASCII symbols, " +
            "with no spaces or typographic quotes. Enter it as it was given.");
          return;
        }
        form.removeEventListener("submit", submitted);
        sessionStorage.setItem(KEY_STORAGE, key);
        $("forget-key").hidden = false;
        $("key-input").value = "";
        form.hidden = true;
        $("key-input").removeAttribute("aria-invalid");
        $("key-reason").textContent = "";  // so the same refusal, if it comes again, is new text to say
        // back where the user was (the form's controls are gone), or, where that cannot take focus now, on to the
        // next thing to do, not <body>
        const back = focused !== document.body ? focused : null;
        back?.focus();
        if (document.activeElement !== back) $("file-input").focus();
        keyEntered = null;
        resolve();
      };
      form.addEventListener("submit", submitted);
    });
  }
  return keyEntered;
}

// Once a key is in use, the page can forget it: to enter another (a metrics key for the metrics link, a key
// rotated), or to leave the tab keyless. The page starts again without it, and asks for one where it must.
function wireKeyForgetting() {
  const forget = $("forget-key");
  forget.hidden = !sessionStorage.getItem(KEY_STORAGE);
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    location.reload();
  });
}

// ------------------------------------------------------------------------------------- what is served

let loadingModels = null;  // the GET /models in progress: callers that ask meanwhile share it

function loadModels() {
  loadingModels ??= askForModels().finally(() => { loadingModels = null; });
  return loadingModels;
}

async function askForModels() {
  // GET /models: {"default": NAME, "models": [what GET /model says of each, the default first]}. Asked again
  // until it answers; and again whenever the server may serve others: a model it named is not served (404),
  // the live panel's models are not these, or the server answers again after it stopped (a restart).
  for (;;) {
    try {
      const response = await api("models");
      if (!response.ok) throw new Error(`GET /models answered ${response.status}`);
      const body = await response.json();
      server.models = body.models;
      server.defaultModel = body.default;
      break;
    } catch (error) {
      $("model-line").textContent =
        `Could not ask the server what it serves (${error.message}); asking again in ${MODELS_RETRY_S} s.`;
      await sleep(1000 * MODELS_RETRY_S);
    }
  }
  describeModels();
}

function describeModels() {
  // Agreement counted against other models, another default, or the same names on other files or engines,
  // says nothing of these: start again.
  const served = JSON.stringify([server.defaultModel, ...server.models.map((m) => `${m.name}=${m.model}@${m.backend}`)]);
  if (served !== agreement.served) {
    Object.assign(agreement, {served, photos: 0, sameTop1: {}});
    $("agreement").hidden = true;
  }
  const main = modelNamed(server.defaultModel);
  const names = server.models.map((m) => m.name).join(", ");
  $("model-line").textContent = server.models.length > 1
    ? `${server.models.length} models: ${names} (default ${server.defaultModel})`
    : `Serving ${servedAs(main)} on ${main.backend}: ${batchingAndCache(main)}`;
  // Stage 1's stand-in answers with real labels at near-uniform probabilities: say what they are worth.
  const standIns = server.models.filter((m) => m.weights === STAND_IN_WEIGHTS).map((m) => m.name);
  $("weights-notice").textContent = `${standIns.join(", ")}: random-init weights, a seeded stand-in (stage 1 ` +
    "had no ImageNet weights). The labels mean nothing; the timings, and how often models agree, are real.";
  $("weights-notice").hidden = !standIns.length;
  $("model-choice").hidden = server.models.length < 2;
  const select = $("model-select");
  const chosen = select.value;
  select.replaceChildren(...server.models.map((m) =>
    element("option", {value: m.name}, `${m.name} (${m.model.split(":")[0]} on ${m.backend})`)));
  select.value = server.models.some((m) => m.name === chosen) ? chosen : server.defaultModel;
}

function servedAs(model) {
  // --backend auto may serve another file for the one named (stage 2's choice): say both.
  const file = model.model.split(":")[0];
  return file.startsWith(`${model.name}.`) ? model.model : `${model.name} as ${model.model}`;
}

function batchingAndCache(model) {
  const {max_batch_size: size, batch_window_ms: window} = model.batching;
  const batching = size > 1 ? `batches of up to ${size} (window ${window} ms)` : "no batching";
  return `${batching}, ${model.cache.size > 0 ? `cache of ${model.cache.size} results` : "no cache"}`;
}

function modelNamed(name) {
  return server.models.find((m) => m.name === name) || server.models[0];
}

// ------------------------------------------------------------------------------------------ classify

async function classifyAll(files) {
  const photos = [...files];
  if (!photos.length) return;
  $("empty").hidden = $("drop-note").hidden = true;
  const cards = photos.map(addCard);
  const attempts = cards.map((card, i) => showPending(photos[i], card));
  // A screen reader hears one photo's steps and outcome; for several, their start and the batch's outcome only
  // (a dozen outcomes within a second are half a minute of speech, or dropped).
  const several = photos.length > 1;
  if (several) announce(`Classifying ${photos.length} photos…`, "batch");
  let next = 0, answered = 0;
  const worker = async () => {
    while (next < photos.length) {
      const i = next++;
      // A photo cancelled while it waited for its turn is never sent.
      if (!attempts[i].signal.aborted && await classifyPhoto(photos[i], cards[i], attempts[i], several)) answered += 1;
    }
  };
  await Promise.all(Array.from({length: Math.min(UPLOADS_AT_ONCE, photos.length)}, worker));
  if (several) {
    const failed = photos.length - answered;
    announce(`${photos.length} photos done: ${answered} classified` +
      (failed ? `, ${failed} not (see each photo)` : ""), "batch");
  }
}

function addCard(file) {
  const card = $("photo-template").content.firstElementChild.cloneNode(true);
  const image = card.querySelector("img");
  image.src = URL.createObjectURL(file);
  image.alt = `Photo ${file.name}`;
  image.addEventListener("load", () => URL.revokeObjectURL(image.src), {once: true});
  image.addEventListener("error", () => {  // not a picture the browser can show: say so, not a broken icon
    URL.revokeObjectURL(image.src);
    image.replaceWith(element("span", {className: "no-preview"}, "no preview"));
  }, {once: true});
  card.querySelector("figcaption").textContent = `${file.name} · ${formatBytes(file.size)}`;
  card.querySelector("h3").textContent = file.name;  // to go from photo to photo by heading
  $("photos").prepend(card);
  return card;
}

// The card's pending line with a Cancel button, for a new attempt at its photo; the attempt's AbortController.
// Cancelling answers the card at once (a photo still waiting its turn is never sent), and aborts the attempt's
// uploads: the server then drops the work of any it has (a closed connection).
function showPending(file, card) {
  const attempt = new AbortController();
  const cancel = photoButton("cancel", "Cancel", file, card, () => {
    attempt.abort();
    card.querySelector(".outcomes").replaceChildren(element("p", {className: "cancelled"}, "Cancelled"),
      sendAgainButton(file, card));
    card.removeAttribute("aria-busy");
    announce(`${file.name}: cancelled`, file.name);
  });
  const pending = element("p", {className: "pending"}, "Waiting for its turn to upload…");  // UPLOADS_AT_ONCE
  card.querySelector(".outcomes").replaceChildren(pending, cancel);
  card.setAttribute("aria-busy", "true");
  return attempt;
}

// `quiet`: one of several photos chosen together, whose steps and outcome are not announced (classifyAll).
async function classifyPhoto(file, card, attempt, quiet = false) {
  const outcomes = card.querySelector(".outcomes");
  const {blob, note} = $("downscale").checked ? await downscale(file) : {blob: file, note: null};
  const comparing = $("compare").checked && server.models.length > 1;
  const names = comparing ? server.models.map((m) => m.name) : [$("model-select").value || server.defaultModel];
  const shrunk = $("downscale").checked;
  const pending = outcomes.querySelector(".pending");  // this attempt's: after Send again, another's is there
  // `announced`: a step said aloud too (not each progress tick)
  const waiting = (text, announced = false) => {
    if (!pending.isConnected) return;
    pending.replaceChildren(text);
    if (announced && !quiet) announce(`${file.name}: ${text}`, file.name);
  };
  waiting("Uploading…", true);
  // The photo's uploads under way (one a model), summed: what has gone of the bytes they send.
  const sent = names.map(() => [0, 0]);
  const uploaded = (i) => (sentBytes, totalBytes) => {
    sent[i] = [sentBytes, totalBytes];
    const [done, total] = sent.reduce(([d, t], [s, n]) => [d + s, t + n], [0, 0]);
    waiting(done < total ? `Uploading: ${formatBytes(done)} of ${formatBytes(total)} ` +
                           `(${Math.floor((100 * done) / total)}%)…` : "Classifying…");
  };
  const results = await Promise.all(names.map((name, i) =>
    predict(blob, file.name, name, shrunk, waiting, file, attempt.signal, uploaded(i))));
  if (attempt.signal.aborted) return false;  // the Cancel button answered the card
  // With several models served, every answer says whose it is, compared or not.
  const nodes = results.map((result, i) => renderResult(result, server.models.length > 1 ? names[i] : null));
  // Focus on the Cancel button going away stays on the photo, not at the page's start.
  const hadFocus = outcomes.contains(document.activeElement);
  outcomes.replaceChildren(...(comparing ? [element("div", {className: "compare"}, ...nodes)] : nodes));
  if (note) outcomes.prepend(element("p", {className: "hint"}, note));
  if (comparing) outcomes.append(compareTop1(names, results));
  card.removeAttribute("aria-busy");
  if (hadFocus) focusPhoto(card);
  const first = results[0];
  if (!quiet) {
    const whose = comparing ? `${names[0]}: ` : "";  // compare mode: the first model's, then the top-1 line
    announce(`${file.name}: ${whose}` + (first.error
      ? first.error
      : `most likely ${first.predictions[0].label}, ${formatPercent(first.predictions[0].probability)}`) +
      (comparing ? `. ${outcomes.querySelector(".agreement-line").textContent}` : ""), file.name);
  }
  const failed = results.filter((result) => result.error);
  // Not where the file is the fault and the browser cannot show it either (see RESENDING_CANNOT_HELP).
  const preview = card.querySelector(".thumb img");
  const shown = preview !== null && preview.complete && preview.naturalWidth > 0;
  if (failed.some((result) => shown || !RESENDING_CANNOT_HELP.includes(result.status))) {
    outcomes.append(sendAgainButton(file, card));
  }
  return !failed.length;
}

// A failed photo can be sent again as it is, with the options as they are now (a server back up, "Shrink large
// photos" ticked after a 413, another model chosen), without choosing the file again.
function sendAgainButton(file, card) {
  return photoButton("send-again", "Send again", file, card, () => classifyPhoto(file, card, showPending(file, card)));
}

// A button of a photo's outcome, which `pressed` replaces: named with its photo for a screen reader, after the
// words it shows (a voice user says what they see); once pressed, focus stays on the photo, as the button goes,
// not back at the page's start.
function photoButton(className, words, file, card, pressed) {
  const button = element("button", {type: "button", className}, words,
    element("span", {className: "visually-hidden"}, ` (${file.name})`));
  button.addEventListener("click", () => {
    focusPhoto(card);
    pressed();
  });
  return button;
}

// Focus on a photo's card: where it goes when what had it in the card is replaced.
function focusPhoto(card) {
  card.tabIndex = -1;
  card.focus();
}

// Multipart's part headers and boundaries around the file: what the server's upload limit counts besides it.
const MULTIPART_OVERHEAD_BYTES = 512;
const SHRINK_ADVICE = "tick “Shrink large photos” to send a smaller copy of a photo over 512 px on its short " +
  "side, or save it smaller";

// `original`: the photo chosen, of which `blob` may be the shrunk copy (for advice on a refusal). `signal` aborts
// the upload and any wait to send it again; `onUploadProgress` as send() takes it.
async function predict(blob, filename, modelName, shrunk, waiting, original = blob, signal, onUploadProgress) {
  const limits = modelNamed(modelName)?.limits ?? {};
  const limit = limits.max_upload_bytes;
  if (limit && blob.size + MULTIPART_OVERHEAD_BYTES + filename.length > limit) {
    const advice = await shrinkAdvice(original, shrunk, limits.max_pixels);
    return {error: `${formatBytes(blob.size)} is over the server's upload limit of ${formatBytes(limit)}${advice}`};
  }
  const form = new FormData();
  form.append("file", blob, filename);
  const url = modelName ? `predict?model=${encodeURIComponent(modelName)}` : "predict";  // none known: the default
  let response, text, started, sent = 0, busy = 0;
  const firstSent = performance.now();
  try {
    for (;;) {
      started = performance.now();  // the round trip is the answered attempt's, not the waits before it
      response = await api(url, {method: "POST", body: form, signal, onUploadProgress});
      text = await response.text();
      sent += 1;
      const waitS = retryAfterS(response);
      const waitMs = 1000 * waitS * (1 + RETRY_SPREAD * Math.random());
      const turnsLeft = response.status === 429
        ? performance.now() - firstSent + waitMs <= 1000 * RATE_TURNS_MAX_S
        : ++busy <= BUSY_RETRIES;  // 503s counted on their own: turns taken at a key's rate spend none
      if (!RETRIED_STATUSES.includes(response.status) || !turnsLeft || waitS > RETRY_AFTER_MAX_S) break;
      const why = response.status === 429 ? "Over this key's rate" : "Server busy";
      waiting(`${why} (${response.status}): sending again in ${waitS} s (try ${sent + 1})…`, true);
      await sleep(waitMs, signal);
    }
  } catch (error) {
    if (signal?.aborted) return {error: "Cancelled"};  // not shown: the Cancel button answered the card
    if (error instanceof RangeError) return {error: error.message};  // an answer, not one a Response can hold
    return {error: `The server could not be reached (${error.message})`};
  }
  const roundTripMs = performance.now() - started;
  let body = null;
  try { body = JSON.parse(text); } catch { /* not JSON: shown as text below */ }
  if (!response.ok) {
    const reason = body && typeof body.detail === "string" ? body.detail : text.slice(0, 300) || response.statusText;
    if (response.status === 404 && reason.startsWith("no model named")) loadModels();  // what is served changed
    const advice = response.status === 413 ? await shrinkAdvice(original, shrunk, limits.max_pixels) : "";
    const tries = RETRIED_STATUSES.includes(response.status) && sent > 1 ? ` (sent ${sent} times)` : "";
    return {error: `${response.status}: ${reason}${advice}${tries}`, status: response.status};
  }
  if (!Array.isArray(body?.predictions) || !body.predictions.length) {  // e.g. a proxy's page or empty answer
    return {error: `${response.status}: not a classification (${text.slice(0, 100) || "an empty answer"})`};
  }
  return {...body, roundTripMs};
}

async function shrinkAdvice(original, shrunk, maxPixels) {
  // For a photo over the upload or pixel limit: whether "Shrink large photos" helps. It sends a copy
  // DOWNSCALE_SHORT_SIDE px on its short side, so it helps a photo larger than that whose copy fits the pixel
  // limit; a photo the browser cannot decode gets no advice (the server says what it is).
  let width, height;
  try {
    const bitmap = await createImageBitmap(original);
    ({width, height} = bitmap);
    bitmap.close();
  } catch {
    return "";
  }
  const scale = DOWNSCALE_SHORT_SIDE / Math.min(width, height);
  if (scale >= 1) return `; “Shrink large photos” leaves a ${width}×${height} photo as it is: save it smaller`;
  const [w, h] = [Math.round(width * scale), Math.round(height * scale)];
  if (maxPixels && w * h > maxPixels) {
    return `; even shrunk to ${w}×${h} it is over the server's limit of ${maxPixels.toLocaleString("en")} pixels: crop it`;
  }
  return shrunk ? "; save it smaller (say, as a JPEG) to send it" : `; ${SHRINK_ADVICE}`;
}

function retryAfterS(response) {
  return Number(response.headers.get("Retry-After")) || 1;  // the server sends whole seconds with 429 and 503
}

// Rejects with an AbortError as soon as `signal` aborts (at once if it has); `ms` Infinity: only then.
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    let timer = null;
    const cancelled = () => {
      clearTimeout(timer);
      reject(new DOMException("cancelled", "AbortError"));
    };
    if (signal?.aborted) {
      cancelled();
      return;
    }
    if (ms !== Infinity) {
      timer = setTimeout(() => {
        signal?.removeEventListener("abort", cancelled);
        resolve();
      }, ms);
    }
    signal?.addEventListener("abort", cancelled, {once: true});
  });
}

function renderResult(result, heading) {
  const box = element("div", {className: "result"});
  if (heading) box.append(element("h4", {}, heading));
  if (result.error) {
    box.append(element("p", {className: "error"}, result.error));  // announced by #announce, once a batch
    return box;
  }
  const count = result.predictions.length;
  // role list: Safari drops it from a list styled without markers
  box.append(element("ol", {className: "top5", role: "list", "aria-label": `Top ${count} classes`},
    ...result.predictions.map(topItem)));
  const hit = result.cache_hit;
  box.append(definitions("timings", [
    ["queue", hit ? "–" : formatMs(result.queue_ms)],
    ["decode + preprocess", hit ? "–" : formatMs(result.preprocess_ms)],
    ["inference", hit ? "–" : formatMs(result.inference_ms)],
    ["round trip", formatMs(result.roundTripMs)],
    ["batch size", hit ? "–" : String(result.batch_size)],
    ["cache", hit ? "hit: no inference ran" : "miss"],
  ]));
  return box;
}

function topItem(prediction) {
  const percent = formatPercent(prediction.probability);
  const bar = element("span", {className: "bar", "aria-hidden": "true"}, element("span"));
  bar.firstChild.style.width = `${Math.max(100 * prediction.probability, 0.5)}%`;
  return element("li", {"data-class-id": String(prediction.class_id), "data-probability": String(prediction.probability)},
    element("span", {className: "label"}, prediction.label),
    element("span", {className: "percent"}, percent),
    bar);
}

function compareTop1(names, results) {
  const top1 = results.map((r) => (r.error ? null : r.predictions[0]));
  const reference = top1[names.indexOf(server.defaultModel)] || top1[0];
  const answered = top1.filter(Boolean);
  let text;
  if (!reference || answered.length < names.length) {
    text = "Top-1: not every model answered";
  } else if (answered.every((p) => p.class_id === reference.class_id)) {
    text = `Top-1: all ${names.length} models agree (${reference.label})`;
  } else {
    text = "Top-1 differs: " + names.map((n, i) => `${n} → ${top1[i].label}`).join(", ");
  }
  if (reference && answered.length === names.length) recordAgreement(names, top1, reference);
  return element("p", {className: "agreement-line"}, text);
}

function recordAgreement(names, top1, reference) {
  agreement.photos += 1;
  names.forEach((name, i) => {
    if (name === server.defaultModel) return;
    agreement.sameTop1[name] = (agreement.sameTop1[name] || 0) + (top1[i].class_id === reference.class_id ? 1 : 0);
  });
  const parts = Object.entries(agreement.sameTop1).map(([name, same]) =>
    `${name} ${same}/${agreement.photos} (${Math.round((100 * same) / agreement.photos)}%)`);
  $("agreement").textContent = `Top-1 agreement with ${server.defaultModel} over the photos compared: ${parts.join(", ")}`;
  $("agreement").hidden = false;
}

async function downscale(file) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    return {blob: file, note: null};  // the browser cannot decode it: send it as it is, the server says why
  }
  const {width, height} = bitmap;
  const scale = DOWNSCALE_SHORT_SIDE / Math.min(width, height);
  if (scale >= 1) {
    bitmap.close();
    return {blob: file, note: null};
  }
  const canvas = document.createElement("canvas");
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  const context = canvas.getContext("2d");
  context.imageSmoothingQuality = "high";
  context.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", DOWNSCALE_QUALITY));
  return {blob, note: `Shrunk in the browser: ${width}×${height} → ${canvas.width}×${canvas.height}, ` +
                      `${formatBytes(file.size)} → ${formatBytes(blob.size)} uploaded`};
}

// ------------------------------------------------------------------------------- choose, drop, paste

function wireInputs() {
  if (/Mac|iPhone|iPad/.test(navigator.platform)) $("paste-key").textContent = "⌘";  // not Ctrl there
  const compare = $("compare");
  compare.addEventListener("change", () => { $("model-select").disabled = compare.checked; });  // all answer then
  const input = $("file-input");
  input.addEventListener("change", () => {
    classifyAll(input.files);
    input.value = "";  // choosing the same photo again is a new request (and a cache hit)
  });
  const zone = $("drop-zone");
  // The whole window takes drops, so a photo dropped a little off target is not opened by the browser instead.
  window.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("dragging");
  });
  window.addEventListener("dragleave", (event) => {
    if (!event.relatedTarget) zone.classList.remove("dragging");
  });
  window.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    // An image dragged from another site's page comes as its address: fetching that is the browser's to refuse.
    const linkOnly = !event.dataTransfer.files.length && event.dataTransfer.types.includes("text/uri-list");
    $("drop-note").hidden = !linkOnly;
    say($("drop-note"), linkOnly  // said again when the same link is dropped again
      ? "That was a link, not a file: save the image, then drop or choose the saved file." : "");
    classifyAll(event.dataTransfer.files);  // anything dropped is sent: the server says what is wrong with it
  });
  let pasted = 0;
  document.addEventListener("paste", (event) => {
    // Browsers call every image pasted from the clipboard image.png (a file copied in a file manager keeps its
    // name): numbered, their cards, buttons and announcements differ.
    const files = [...event.clipboardData.files].map((file) => /^image\.\w+$/.test(file.name)
      ? new File([file], `pasted ${file.name.replace("image", `image ${++pasted}`)}`, {type: file.type})
      : file);
    classifyAll(files);  // pasted text has no files: nothing is sent
  });
}

// With keys on, the plain link would open /metrics without the key (a navigation sends no header): a 401.
// With this tab's key the page fetches them and opens the text, or the refusal (an infer key's 403).
function wireMetricsLink() {
  $("metrics-link").addEventListener("click", async (event) => {
    if (!sessionStorage.getItem(KEY_STORAGE)) return;  // no key in use: the link as it is
    event.preventDefault();
    const tab = window.open("", "_blank");  // opened during the click, so no popup blocker stops it
    if (!tab) return;
    tab.document.title = "Prometheus metrics";
    tab.document.body.textContent = "Asking the server for GET /metrics (if it asks for another API key, " +
      "enter it in the page's tab)…";
    let shown;
    try {
      const response = await api("metrics", {cache: "no-store"}, false);
      const text = await response.text();
      shown = response.ok ? text : `GET /metrics answered ${response.status} to this tab's API key:\n\n${text}\n`;
    } catch (error) {
      shown = `GET /metrics failed: the server does not answer (${error.message})\n`;
    }
    const url = URL.createObjectURL(new Blob([shown], {type: "text/plain"}));
    tab.location = url;
    setTimeout(() => URL.revokeObjectURL(url), 60_000);  // the tab has loaded it by then
  });
}

// ------------------------------------------------------------------------------------------ live panel

// Returns how long to wait before asking again: the refresh interval, or a 429's Retry-After.
async function refreshStats() {
  // nobody is looking, or the figures are paused (they change every refresh, WCAG's "pause, stop, hide")
  if (document.hidden || statsPaused) return STATS_EVERY_MS;
  let stats;
  try {
    const response = await api("stats", {cache: "no-store"});
    if (statsPaused) return STATS_EVERY_MS;  // paused while it was asked for: the figures stay as they are
    if (response.status === 429) {  // this key's rate: keep the figures, and spend none of its budget for a while
      const waitMs = Math.max(statsDelayMs(), 1000 * retryAfterS(response));
      const figures = rpsHistory.length ? "Figures from before: this" : "No figures yet: this";
      $("live-window").textContent =
        `${figures} key is over its rate (its photos come first); asking again in ${Math.round(waitMs / 1000)} s.`;
      return waitMs;
    }
    if (!response.ok) throw new Error(`GET /stats answered ${response.status}`);
    stats = await response.json();
  } catch (error) {
    if (statsPaused) return STATS_EVERY_MS;
    // What is served, said above, may be gone too: say so until it answers again (describeModels says it anew).
    if (!statsFailed && server.models.length && error instanceof TypeError) {
      $("model-line").textContent += " (the server does not answer now)";
    }
    statsFailed = true;
    // Figures from before would read as the server's now: blank them.
    const why = error instanceof TypeError ? `the server does not answer (${error.message})` : error.message;
    $("live-window").textContent = `No stats: ${why}. The figures return when the server answers.`;
    for (const figure of document.querySelectorAll(".live dd")) figure.textContent = "–";
    $("batch-sizes").replaceChildren();
    $("batch-mean").textContent = "";
    $("per-model").hidden = true;
    $("rejected").textContent = "";
    rpsHistory.length = 0;
    $("rps-spark").querySelector("polyline").setAttribute("points", "");
    $("spark-peak").textContent = "";
    return STATS_EVERY_MS;
  }
  if (statsPaused) return STATS_EVERY_MS;
  const names = Object.keys(stats.models);
  if (statsFailed || names.join() !== server.models.map((m) => m.name).join()) {
    if (server.models.length) loadModels();  // back after it stopped, or other models: what is served now?
    statsFailed = false;
  }
  const delayMs = statsDelayMs();
  renderStats(stats, delayMs);
  return delayMs;
}

function renderStats(stats, delayMs) {
  const paced = delayMs > STATS_EVERY_MS ? " (this key's rate goes to photos first)" : "";
  $("live-window").textContent = `${windowLabel(stats.window_s, delayMs)} Refreshed every ${Number((delayMs / 1000).toFixed(1))} s${paced}. ` +
    "Quantiles are estimated from histogram buckets; counts and means are exact.";
  $("stat-rps").textContent = stats.requests_per_s.toFixed(1);
  $("stat-requests").textContent = String(stats.requests);
  $("stat-p50").textContent = formatMs(stats.latency.p50_ms);
  $("stat-p95").textContent = formatMs(stats.latency.p95_ms);
  $("stat-p99").textContent = formatMs(stats.latency.p99_ms);
  $("stat-hit-rate").textContent = stats.cache.hit_rate === null ? "–" : `${Math.round(100 * stats.cache.hit_rate)}%`;
  $("stat-queue").textContent = String(stats.queue_depth);
  $("stat-in-flight").textContent = String(stats.in_flight);
  $("stage-queue").textContent = formatMs(stats.stages.queue.mean_ms);
  $("stage-preprocess").textContent = formatMs(stats.stages.preprocess.mean_ms);
  $("stage-inference").textContent = formatMs(stats.stages.inference.mean_ms);
  for (const [role, cores] of Object.entries(stats.cpu_cores)) $(`cpu-${role}`).textContent = cores.toFixed(2);
  renderBatchSizes(stats.batch_size);
  renderPerModel(stats.models);
  const rejected = Object.entries(stats.rejected).filter(([, count]) => count > 0);
  $("rejected").textContent = rejected.length
    ? "Refused: " + rejected.map(([reason, count]) => `${reason.replaceAll("_", " ")} ${count}`).join(", ")
    : "No request refused.";
  rpsHistory.push(stats.requests_per_s);
  if (rpsHistory.length > SPARK_POINTS) rpsHistory.shift();
  drawSpark();
}

function windowLabel(seconds, refreshMs = STATS_EVERY_MS) {
  // GET /stats covers the last minute (to within a refresh, `refreshMs`: longer for a rate-limited key) once the
  // server has run one and someone has been reading the stats for a minute; otherwise its window is shorter or
  // longer, and the panel says why.
  const shown = Math.round(seconds);
  if (shown < STATS_WINDOW_S) return `Last ${shown} s: everything since the server started (the window grows to a minute).`;
  if (seconds < STATS_WINDOW_S + 2 * refreshMs / 1000) return `Last ${shown} s.`;
  const length = shown < 120 ? `${shown} s` : `${Math.floor(shown / 60)} min ${shown % 60} s`;
  return `Last ${length}: the stats went unread for a while, so this reaches back to their last reading or the ` +
    "server's start (a minute again once this page has watched for one).";
}

function renderBatchSizes(batches) {
  const largest = Math.max(0, ...server.models.map((m) => m.batching?.max_batch_size || 0));  // 0: not known yet
  const buckets = batches.buckets.filter((b) => !largest || b.smallest <= largest);
  const most = Math.max(1, ...buckets.map((b) => b.inferences));
  $("batch-mean").textContent = batches.mean === null ? ""
    : `(mean ${batches.mean.toFixed(1)} over ${batches.inferences} ${batches.inferences === 1 ? "call" : "calls"})`;
  $("batch-sizes").replaceChildren(...buckets.map((b) => {
    const range = b.largest === null ? `${b.smallest}+` : b.largest === b.smallest ? `${b.smallest}` : `${b.smallest}–${b.largest}`;
    const bar = element("span", {className: "bar", "aria-hidden": "true"}, element("span"));
    bar.firstChild.style.width = `${(100 * b.inferences) / most}%`;
    // Read aloud as "batch size 3–4, 2 inference calls" (an aria-label on a span is not read).
    return element("div", {className: "histogram-row"},
      element("span", {className: "range"}, element("span", {className: "visually-hidden"}, "batch size "), range),
      bar,
      element("span", {className: "count"}, String(b.inferences)),
      element("span", {className: "visually-hidden"}, " inference calls"));
  }));
}

function renderPerModel(models) {
  // One model's figures are the server's, already shown above: the table is for two or more.
  const names = Object.keys(models);
  $("per-model").hidden = names.length < 2;
  if (names.length < 2) return;
  $("per-model").querySelector("tbody").replaceChildren(...names.map((name) => {
    const m = models[name];
    return element("tr", {"data-model": name},
      element("th", {scope: "row"}, name),
      element("td", {}, m.requests_per_s.toFixed(1)),
      element("td", {}, formatMs(m.latency.p50_ms)),
      element("td", {}, formatMs(m.latency.p95_ms)),
      element("td", {}, m.cache_hit_rate === null ? "–" : `${Math.round(100 * m.cache_hit_rate)}%`));
  }));
}

function drawSpark() {
  const top = Math.max(1, ...rpsHistory);  // at least 1/s full height, so an idle server stays a flat line
  const step = 120 / (SPARK_POINTS - 1);
  const points = rpsHistory.map((rps, i) => `${(i + SPARK_POINTS - rpsHistory.length) * step},${31 - (28 * rps) / top}`);
  $("rps-spark").querySelector("polyline").setAttribute("points", points.join(" "));
  $("spark-peak").textContent = `peak ${Math.max(...rpsHistory).toFixed(1)}/s`;
}

let statsPaused = false;

function wireStatsPause() {
  const pause = $("pause-stats");
  pause.addEventListener("click", () => {
    statsPaused = !statsPaused;
    pause.setAttribute("aria-pressed", String(statsPaused));
    if (statsPaused) $("live-window").textContent = "Paused: these are the figures of the last refresh.";
    else refreshStats();
  });
}

async function statsLoop() {
  setTimeout(statsLoop, await refreshStats());  // not setInterval: a slow answer never piles up requests
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden) refreshStats();
});

if (!KEY_CHARACTERS.test(sessionStorage.getItem(KEY_STORAGE) ?? "-")) sessionStorage.removeItem(KEY_STORAGE);
wireKeyForgetting();
wireInputs();
wireMetricsLink();
wireStatsPause();
loadModels();
statsLoop();
