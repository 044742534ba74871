// gpucleanup in JupyterLab: the GPU memory and park state of the notebook in focus, in the status bar.
// One request per refresh (GET api/gpucleanup/kernels/<kernel id>), at most every 2 s and none while the tab is
// hidden; the server answers it without counting it as activity, as it does for its own page.
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';
import { IStatusBar } from '@jupyterlab/statusbar';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';

const REFRESH_MS = 2000;
const UNITS = [['TiB', 2 ** 40], ['GiB', 2 ** 30], ['MiB', 2 ** 20], ['KiB', 2 ** 10]];

// the units of the line under each cell and of %gpumem (gpucleanup/units.py)
export function formatBytes(n) {
  if (n === null || n === undefined) return '?';
  const abs = Math.abs(n);
  const [unit, size] = UNITS.find(([, s]) => abs >= s) || ['B', 1];
  const value = abs / size;
  const text = unit === 'B' ? String(Math.trunc(value)) : (unit === 'GiB' || unit === 'TiB' || value < 10)
    ? value.toFixed(1) : value.toFixed(0);
  return `${n < 0 ? '-' : ''}${text} ${unit}`;
}

// What the item says for one kernel entry of the server's API; null: nothing to show (no gpucleanup, no GPU used).
export function describe(entry) {
  if (!entry || !entry.gpucleanup) return null;
  const state = (entry.state && entry.state.state) || 'unknown';
  if (entry.parked && (state === 'parked' || state === 'parking')) {
    const bytes = entry.parked.bytes;
    return { text: `GPU parked${bytes ? ' ' + formatBytes(bytes) : ''}`, kind: 'parked',
             title: 'gpucleanup: this kernel\'s GPU memory is in host memory; its next cell brings it back' };
  }
  const held = (entry.held || []).filter((h) => h.bytes > 0);
  if (!held.length) return null;
  const parts = held.map((h) => {
    const cached = h.cached_bytes > 0 ? ` (${formatBytes(h.cached_bytes).replace(/ [KMGT]?i?B$/, '')} cached)` : '';
    return `GPU${h.index === null || h.index === undefined ? '?' : h.index} ${formatBytes(h.bytes)}${cached}`;
  });
  const busy = ['draining', 'waiting', 'running'].includes(state) ? ` · ${state}` : '';
  return { text: parts.join(' · ') + busy, kind: busy ? 'busy' : 'idle',
           title: 'gpucleanup: GPU memory this kernel holds (cached: what its frameworks keep for reuse)' };
}

class GpuItem extends Widget {
  constructor() {
    super();
    this.addClass('gpucleanup-status');
    this.addClass('jp-StatusBar-TextItem');
    this.node.style.padding = '0 5px';
    this.node.dataset.kind = 'none';
  }

  render(said, kernel) {
    this.node.dataset.kernel = said ? kernel : '';  // which kernel the figures are of
    this.node.textContent = said ? said.text : '';
    this.node.title = said ? said.title : '';
    this.node.dataset.kind = said ? said.kind : 'none';
    this.node.style.fontStyle = said && said.kind === 'parked' ? 'italic' : '';
  }
}


// The item's panel: the kernel's figures per GPU, and Park / Resume / Drain through the server's REST API (the
// server's token, XSRF check and authorizer, as for its page).
function panelBody(entry) {
  const node = document.createElement('div');
  node.className = 'gpucleanup-panel';
  const line = (text) => {
    const div = document.createElement('div');
    div.textContent = text;
    node.appendChild(div);
  };
  const state = (entry.state && entry.state.state) || 'unknown';
  line(`state: ${state}${entry.notebook ? ` · ${entry.notebook}` : ''}`);
  if (entry.parked && entry.parked.bytes) line(`parked in host memory: ${formatBytes(entry.parked.bytes)}`);
  for (const held of entry.held || []) {
    const outside = held.outside_bytes === null || held.outside_bytes === undefined ? '' :
      ` · outside every pool ${formatBytes(held.outside_bytes)}`;
    line(`GPU${held.index}: held ${formatBytes(held.bytes)} · live ${formatBytes(held.live_bytes)} · ` +
         `cached ${formatBytes(held.cached_bytes)}${outside}`);
  }
  return new Widget({ node });
}

async function openPanel(settings, kernel) {
  const base = URLExt.join(settings.baseUrl, 'api/gpucleanup/kernels', encodeURIComponent(kernel));
  const response = await ServerConnection.makeRequest(base, {}, settings);
  if (!response.ok) return null;
  const entry = await response.json();
  const parked = entry.parked !== null && entry.parked !== undefined;
  const action = parked ? 'resume' : 'park';
  const result = await showDialog({
    title: 'gpucleanup',
    body: panelBody(entry),
    buttons: [Dialog.cancelButton({ label: 'Close' }), Dialog.createButton({ label: 'Drain', accept: true }),
              Dialog.okButton({ label: parked ? 'Resume' : 'Park' })],
  });
  if (!result.button.accept) return null;
  const what = result.button.label === 'Drain' ? 'drain' : action;
  const done = await ServerConnection.makeRequest(URLExt.join(base, what), { method: 'POST', body: '{}' }, settings);
  const answer = await done.json().catch(() => ({}));
  await showDialog({ title: 'gpucleanup', body: answer.message || `${what}: HTTP ${done.status}`,
                     buttons: [Dialog.okButton({ label: 'OK' })] });
  return what;
}

const plugin = {
  id: 'gpucleanup:status-item',
  description: 'The GPU memory and park state of the notebook in focus, from gpucleanup.',
  autoStart: true,
  requires: [IStatusBar, INotebookTracker],
  activate: (app, statusBar, tracker) => {
    const item = new GpuItem();
    const settings = app.serviceManager.serverSettings;
    const activeStateChanged = new Signal(item);  // the status bar shows the item while isActive() says so
    let shown = null;
    const say = (said, kernel) => {
      const was = shown !== null;
      shown = said;
      item.render(said, kernel);
      if (was !== (said !== null)) activeStateChanged.emit(undefined);
    };
    const kernelId = () => {
      const widget = tracker.currentWidget;
      const kernel = widget && widget.sessionContext.session && widget.sessionContext.session.kernel;
      return kernel ? kernel.id : null;
    };
    const refresh = async () => {
      if (document.visibilityState === 'hidden') return;
      const id = kernelId();
      if (!id) {
        say(null);
        return;
      }
      const url = URLExt.join(settings.baseUrl, 'api/gpucleanup/kernels', encodeURIComponent(id));
      let said = null;
      try {
        const response = await ServerConnection.makeRequest(url, {}, settings);
        said = response.ok ? describe(await response.json()) : null;
      } catch (err) {
        said = null;  // no gpucleanup server extension, or the server went away: nothing to say
      }
      if (kernelId() === id) say(said, id);
    };
    item.node.style.cursor = 'pointer';
    item.node.addEventListener('click', () => {
      const kernel = item.node.dataset.kernel;
      if (kernel) void openPanel(settings, kernel).then(() => refresh());
    });
    statusBar.registerStatusItem(plugin.id, {
      item,
      align: 'left',
      rank: 4,
      isActive: () => shown !== null,
      activeStateChanged,
    });
    tracker.currentChanged.connect(() => void refresh());
    document.addEventListener('visibilitychange', () => void refresh());
    setInterval(() => void refresh(), REFRESH_MS);
    void refresh();
  },
};

export default [plugin];
