// The console's one script: auto-refresh when asked (?refresh=N), never while a form is being filled.
// Served from /ops/static (CSP script-src 'self': no inline script runs). Without it the pages work the same,
// they just do not refresh.
(function () {
  "use strict";
  var seconds = parseInt(document.body.getAttribute("data-refresh") || "0", 10);
  if (!(seconds > 0)) {
    return;
  }
  var state = document.getElementById("refresh-state");
  var touched = false;
  function mark() {
    touched = true;
  }
  // Typing, picking or ticking anything counts: a half-filled form is never thrown away.
  document.addEventListener("input", mark, true);
  document.addEventListener("change", mark, true);
  function busy() {
    var el = document.activeElement;
    var tag = el && el.tagName ? el.tagName.toUpperCase() : "";
    return touched || tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT";
  }
  function tick() {
    if (busy()) {
      if (state) {
        state.textContent = "auto-refresh paused: a form is being filled";
      }
      document.body.setAttribute("data-refresh-paused", "1");
      window.setTimeout(tick, seconds * 1000);
      return;
    }
    window.location.reload();
  }
  window.setTimeout(tick, seconds * 1000);
})();
