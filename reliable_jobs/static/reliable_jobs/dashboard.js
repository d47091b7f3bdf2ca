// Refresh the live part of the jobs dashboard every few seconds: fetch this
// same page and swap #rj-live. No framework and no build step; if a fetch
// fails the last numbers stay and the next tick tries again.
(function () {
  "use strict";
  const live = document.getElementById("rj-live");
  if (!live) {
    return;
  }
  const every = Number(live.dataset.refreshMs) || 5000;
  async function refresh() {
    if (document.hidden) {
      return;
    }
    try {
      const response = await fetch(window.location.href, {credentials: "same-origin"});
      if (!response.ok) {
        return;
      }
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById("rj-live");
      if (fresh) {
        // Parsed (inert) markup the server already escaped; scripts in it never run.
        live.replaceChildren(...fresh.childNodes);
      }
    } catch (error) {
      // Offline or the server restarting: keep what is shown.
    }
  }
  window.setInterval(refresh, every);
})();
