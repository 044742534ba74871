// gpucleanup in JupyterLab: the GPU memory and park state of the notebook in focus in the status bar, every
// kernel's in a section of the Running panel, and the page /gpucleanup in a main-area tab. Notebook 7 has no
// status bar: there the item goes to the top of the notebook's page, beside the kernel's logo.
// One request per refresh for all of them (GET api/gpucleanup/kernels, no cards), every refreshSeconds (2 s by
// default) and none while the tab is hidden; the server answers it without counting it as activity, as it does
// for its own page.
import { Dialog, ICommandPalette, MainAreaWidget, showDialog } from '@jupyterlab/apputils';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';
import { IStatusBar } from '@jupyterlab/statusbar';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IRunningSessionManagers } from '@jupyterlab/running';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';
import { LabIcon } from '@jupyterlab/ui-components';
// the units of the line under each cell and of %gpumem, shared with the page /gpucleanup
import { formatBytes, formatDuration } from '../../ipython_ext/gpucleanup/server/static/units.js';

const PLUGIN_ID = 'gpucleanup:status-item';
const OPEN_PAGE = 'gpucleanup:open-page';
// the settings' defaults (schema/status-item.json says the same)
const DEFAULTS = { refreshSeconds: 2, showCached: true, hideWithoutGpu: true };

// What the item says for one kernel entry of the server's API; null: nothing to show (no gpucleanup, or no GPU
// used while hideWithoutGpu is on). showCached off leaves out the "(x cached)" part.
export function describe(entry, options = DEFAULTS) {
  if (!entry || !entry.gpucleanup) return null;
  const state = (entry.state && entry.state.state) || 'unknown';
  if (entry.parked && (state === 'parked' || state === 'parking')) {
    const bytes = entry.parked.bytes;
    return { text: `GPU parked${bytes ? ' ' + formatBytes(bytes) : ''}`, kind: 'parked',
             title: 'gpucleanup: this kernel\'s GPU memory is in host memory; its next cell brings it back' };
  }
  const held = (entry.held || []).filter((h) => h.bytes > 0);
  if (!held.length) {
    return options.hideWithoutGpu ? null : { text: 'GPU none', kind: 'idle',
      title: 'gpucleanup: this kernel holds no GPU memory' };
  }
  const parts = held.map((h) => {
    // the cached figure without its unit where it is the held figure's (2.1 GiB (1.6 cached)), with it where
    // not (3.5 GiB (512 MiB cached))
    const heldText = formatBytes(h.bytes);
    const [number, unit] = formatBytes(h.cached_bytes).split(' ');
    const cached = options.showCached && h.cached_bytes > 0 ?
      ` (${unit === heldText.split(' ')[1] ? number : `${number} ${unit}`} cached)` : '';
    return `GPU${h.index === null || h.index === undefined ? '?' : h.index} ${heldText}${cached}`;
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
    this.node.style.cursor = 'pointer';
    this.node.dataset.kind = 'none';
  }

  render(said, kernel) {
    this.node.dataset.kernel = said ? kernel : '';  // which kernel the figures are of
    this.node.textContent = said ? said.text : '';
    this.node.title = said ? said.title : '';
    this.node.dataset.kind = said ? said.kind : 'none';
    // a look of its own while parked (italics) and while the kernel is busy (running, draining, waiting)
    this.node.style.fontStyle = said && said.kind === 'parked' ? 'italic' : '';
    this.node.style.color = said && said.kind === 'busy' ? 'var(--jp-warn-color1)' : '';
  }
}

// Every kernel the server knows, asked for once per refresh for the status item and the Running section alike.
class Kernels {
  constructor(serverSettings) {
    this.serverSettings = serverSettings;
    this.options = { ...DEFAULTS };
    this.entries = [];
    this.changed = new Signal(this);
    this._timer = null;
    this._asking = false;
  }

  get url() {
    return URLExt.join(this.serverSettings.baseUrl, 'api/gpucleanup/kernels');
  }

  start() {
    if (this._timer !== null) clearInterval(this._timer);
    this._timer = setInterval(() => void this.refresh(), this.options.refreshSeconds * 1000);
    void this.refresh();
  }

  async refresh() {
    if (document.visibilityState === 'hidden' || this._asking) return;
    this._asking = true;
    let entries = [];
    try {
      const response = await ServerConnection.makeRequest(`${this.url}?sort=held&cards=`, {}, this.serverSettings);
      entries = response.ok ? ((await response.json()).kernels || []) : [];
    } catch (err) {
      entries = [];  // no gpucleanup server extension, or the server went away: nothing to say
    } finally {
      this._asking = false;
    }
    this.entries = entries;
    this.changed.emit(entries);
  }

  find(kernelId) {
    return this.entries.find((e) => e.kernel_id === kernelId || e.id === kernelId) || null;
  }

  async act(entryId, what) {
    const url = URLExt.join(this.url, encodeURIComponent(entryId), what);
    const done = await ServerConnection.makeRequest(url, { method: 'POST', body: '{}' }, this.serverSettings);
    const answer = await done.json().catch(() => ({}));
    void this.refresh();
    return answer.message || `${what}: HTTP ${done.status}`;
  }

  async get(entryId, what = '') {
    const url = URLExt.join(this.url, encodeURIComponent(entryId), what);
    const response = await ServerConnection.makeRequest(url, {}, this.serverSettings);
    return response.ok ? response.json() : null;
  }
}

// The item's panel: the kernel's figures per GPU, idle since, what `park --check` says, and Park / Resume / Drain
// through the server's REST API (the server's token, XSRF check and authorizer, as for its page), and the page.
function panelBody(entry, check) {
  const node = document.createElement('div');
  node.className = 'gpucleanup-panel';
  const line = (text, className) => {
    const div = document.createElement('div');
    div.textContent = text;
    if (className) div.className = className;
    node.appendChild(div);
  };
  const state = (entry.state && entry.state.state) || 'unknown';
  line(`state: ${state}${entry.notebook ? ` · ${entry.notebook}` : ''}`);
  if (entry.idle_since_ns !== null && entry.idle_since_ns !== undefined) {
    const since = new Date(entry.idle_since_ns / 1e6).toLocaleTimeString([], { hour12: false });
    line(`idle for ${formatDuration(entry.idle_s)} (since ${since})`, 'gpucleanup-idle');
  }
  if (entry.parked && entry.parked.bytes) line(`parked in host memory: ${formatBytes(entry.parked.bytes)}`);
  for (const held of entry.held || []) {
    const outside = held.outside_bytes === null || held.outside_bytes === undefined ? '' :
      ` · outside every pool ${formatBytes(held.outside_bytes)}`;
    line(`GPU${held.index}: held ${formatBytes(held.bytes)} · live ${formatBytes(held.live_bytes)} · ` +
         `cached ${formatBytes(held.cached_bytes)}${outside}`);
  }
  if (check) line(`park check: ${check.message}`, 'gpucleanup-check');
  return new Widget({ node });
}

async function openPanel(app, kernels, entryId) {
  const entry = await kernels.get(entryId);
  if (!entry) return;
  const parked = entry.parked !== null && entry.parked !== undefined;
  const check = parked ? null : await kernels.get(entryId, 'park-check').catch(() => null);
  const result = await showDialog({
    title: 'gpucleanup',
    body: panelBody(entry, check),
    buttons: [Dialog.cancelButton({ label: 'Close' }), Dialog.createButton({ label: 'Open page', accept: true }),
              Dialog.createButton({ label: 'Drain', accept: true }),
              Dialog.okButton({ label: parked ? 'Resume' : 'Park' })],
  });
  if (!result.button.accept) return;
  if (result.button.label === 'Open page') {
    await app.commands.execute(OPEN_PAGE);
    return;
  }
  const what = result.button.label === 'Drain' ? 'drain' : (parked ? 'resume' : 'park');
  const message = await kernels.act(entryId, what);
  await showDialog({ title: 'gpucleanup', body: message, buttons: [Dialog.okButton({ label: 'OK' })] });
}

// The page /gpucleanup in a main-area tab (the same origin: JupyterLab's login holds for it).
function pageWidget(serverSettings) {
  const frame = document.createElement('iframe');
  frame.src = URLExt.join(serverSettings.baseUrl, 'gpucleanup');
  frame.style.border = '0';
  frame.style.width = '100%';
  frame.style.height = '100%';
  const content = new Widget({ node: frame });
  content.addClass('gpucleanup-page');
  const widget = new MainAreaWidget({ content });
  widget.id = 'gpucleanup-page';
  widget.title.label = 'GPU memory';
  widget.title.closable = true;
  return widget;
}

const parkIcon = new LabIcon({
  name: 'gpucleanup:park',
  svgstr: '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" ' +
          'fill="#616161"><rect x="6" y="5" width="4" height="14"/><rect x="14" y="5" width="4" height="14"/></g></svg>',
});
const gpuIcon = new LabIcon({
  name: 'gpucleanup:gpu',
  svgstr: '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" ' +
          'fill="#616161"><path d="M3 7h18v10H3zM5 9v6h14V9zM6 18h2v2H6zm4 0h2v2h-2zm4 0h2v2h-2z"/></g></svg>',
});

// The Running panel's section: every kernel with gpucleanup, the most GPU memory first (the server's sort=held),
// its figures beside the notebook's name; the item's button parks it; "Park all idle" parks every idle one.
function runningManager(app, kernels) {
  const runningChanged = new Signal(kernels);
  kernels.changed.connect(() => runningChanged.emit(undefined));
  const listed = () => kernels.entries.filter((e) => e.gpucleanup);
  const item = (entry) => {
    const said = describe(entry, { ...kernels.options, hideWithoutGpu: false });
    const parked = said && said.kind === 'parked';
    return {
      className: 'gpucleanup-running-item',
      context: entry.id,
      icon: () => gpuIcon,
      label: () => entry.notebook || entry.id,
      labelTitle: () => `${entry.notebook || ''} (kernel ${entry.id}): ${said ? said.title : ''}`,
      detail: () => (said ? said.text : ''),
      // the notebook opens for this server's own kernels only: another process's discovery file names any path
      open: () => {
        const ours = Array.from(app.serviceManager.kernels.running(), (k) => k.id);
        if (entry.notebook && ours.includes(entry.kernel_id)) {
          void app.commands.execute('docmanager:open', { path: entry.notebook });
        }
      },
      shutdown: parked ? undefined : () => void kernels.act(entry.id, 'park').then(
        (message) => showDialog({ title: 'gpucleanup', body: message, buttons: [Dialog.okButton({ label: 'OK' })] })),
    };
  };
  return {
    name: 'GPU memory',
    running: () => listed().map(item),
    refreshRunning: () => void kernels.refresh(),
    runningChanged,
    shutdownLabel: 'Park',
    shutdownItemIcon: parkIcon,
    shutdownAllLabel: 'Park all idle',
    shutdownAllConfirmationText: 'Park every idle kernel listed here? Each one\'s GPU memory goes to host memory ' +
      'and comes back at its next cell; a kernel that cannot be parked is left as it is.',
    shutdownAll: () => {
      const idle = listed().filter((e) => e.state && e.state.state === 'idle' && !e.parked);
      void Promise.all(idle.map((e) => kernels.act(e.id, 'park').catch(() => null)));
    },
  };
}

const plugin = {
  id: PLUGIN_ID,
  description: 'The GPU memory and park state of the notebook in focus, and of every kernel, from gpucleanup.',
  autoStart: true,
  requires: [],
  // every one optional: JupyterLab has them all; Notebook 7 has no status bar, and its tree page no notebooks
  optional: [IStatusBar, INotebookTracker, ISettingRegistry, IRunningSessionManagers, ICommandPalette],
  activate: (app, statusBar, tracker, settingRegistry, runningManagers, palette) => {
    const serverSettings = app.serviceManager.serverSettings;
    const kernels = new Kernels(serverSettings);
    const item = new GpuItem();
    const activeStateChanged = new Signal(item);  // the status bar shows the item while isActive() says so
    let shown = null;
    const kernelId = () => {
      const widget = tracker && tracker.currentWidget;
      const kernel = widget && widget.sessionContext.session && widget.sessionContext.session.kernel;
      return kernel ? kernel.id : null;
    };
    const render = () => {
      const id = kernelId();
      const entry = id ? kernels.find(id) : null;
      const said = entry ? describe(entry, kernels.options) : null;
      const was = shown !== null;
      shown = said;
      item.render(said, entry ? entry.id : '');
      item.node.dataset.listed = String(kernels.entries.length);  // how many kernels the last refresh listed
      item.setHidden(said === null);  // where the status bar shows it, it follows isActive() below as well
      if (was !== (said !== null)) activeStateChanged.emit(undefined);
    };
    kernels.changed.connect(render);

    app.commands.addCommand(OPEN_PAGE, {
      label: 'GPU memory: open the gpucleanup page',
      execute: () => {
        const widget = pageWidget(serverSettings);
        app.shell.add(widget, 'main');
        app.shell.activateById(widget.id);
        return widget;
      },
    });
    if (palette) palette.addItem({ command: OPEN_PAGE, category: 'gpucleanup' });

    item.node.addEventListener('click', () => {
      const entryId = item.node.dataset.kernel;
      if (entryId) void openPanel(app, kernels, entryId).then(() => kernels.refresh());
    });
    if (tracker && statusBar) {
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 4,
        isActive: () => shown !== null,
        activeStateChanged,
      });
    } else if (tracker) {
      item.addClass('gpucleanup-top');  // Notebook 7: its top area, at the right beside the kernel's logo
      item.node.style.alignSelf = 'center';
      app.shell.add(item, 'top', { rank: 10000 });
    }
    if (runningManagers) runningManagers.add(runningManager(app, kernels));
    if (tracker) tracker.currentChanged.connect(() => { render(); void kernels.refresh(); });
    document.addEventListener('visibilitychange', () => void kernels.refresh());

    const apply = (settings) => {
      const read = settings ? settings.composite : {};
      const seconds = Number(read.refreshSeconds);
      kernels.options = {
        refreshSeconds: Number.isFinite(seconds) ? Math.min(60, Math.max(1, seconds)) : DEFAULTS.refreshSeconds,
        showCached: read.showCached === undefined ? DEFAULTS.showCached : !!read.showCached,
        hideWithoutGpu: read.hideWithoutGpu === undefined ? DEFAULTS.hideWithoutGpu : !!read.hideWithoutGpu,
      };
      kernels.start();
    };
    if (settingRegistry) {
      settingRegistry.load(PLUGIN_ID).then((settings) => {
        settings.changed.connect(() => apply(settings));
        apply(settings);
      }, () => apply(null));  // no schema reached the registry: the defaults
    } else {
      apply(null);
    }
  },
};

export default [plugin];
