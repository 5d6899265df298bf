/**
 * A notebook toolbar item that says when the notebook's kernel has an elastic job running (or a
 * session up), or that its latest job failed; nothing otherwise. A click opens the panel.
 */

import { DocumentRegistry } from '@jupyterlab/docregistry';
import { INotebookModel, NotebookPanel } from '@jupyterlab/notebook';
import { IDisposable } from '@lumino/disposable';
import { Widget } from '@lumino/widgets';

import { IJob } from './api';
import { elapsed } from './format';
import { JobsModel } from './jobs';

export class JobIndicator extends Widget {
  private _pill: HTMLButtonElement;

  constructor(
    private readonly _panel: NotebookPanel,
    private readonly _model: JobsModel,
    private readonly _openPanel: () => void
  ) {
    super();
    this.addClass('enb-indicator-item');
    // A pill inside the toolbar item: the item takes the toolbar's height, the pill its own.
    this._pill = document.createElement('button');
    this._pill.className = 'enb-indicator';
    this._pill.addEventListener('click', () => this._openPanel());
    this.node.append(this._pill);
    _model.changed.connect(this._render, this);
    _model.watch(this);
    this._render();
  }

  dispose(): void {
    this._model.unwatch(this);
    this._model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const jobs = this._model.ofKernel(this._panel.sessionContext.session?.kernel?.id);
    const said = whatToSay(jobs, this._model);
    const pill = this._pill;
    this.node.hidden = pill.hidden = said === null;
    pill.dataset.state = said?.state ?? '';
    pill.textContent = said?.text ?? '';
    pill.title = said ? `${said.title} · click for the Elastic jobs panel` : '';
  }
}

/** Adds the indicator to every notebook's toolbar. */
export class IndicatorExtension
  implements DocumentRegistry.IWidgetExtension<NotebookPanel, INotebookModel>
{
  constructor(
    private readonly _model: JobsModel,
    private readonly _openPanel: () => void
  ) {}

  createNew(panel: NotebookPanel): IDisposable {
    const indicator = new JobIndicator(panel, this._model, this._openPanel);
    if (!panel.toolbar.insertAfter('spacer', 'elastic-nb', indicator)) {
      panel.toolbar.addItem('elastic-nb', indicator);
    }
    return indicator;
  }
}

interface ISaid {
  state: 'running' | 'session' | 'failed';
  text: string;
  title: string;
}

/**
 * Running job or session cell first (the count, the oldest one's elapsed time), then a session
 * that is up, then a latest job that failed; nothing for a notebook whose jobs all went well.
 */
export function whatToSay(jobs: IJob[], model: JobsModel): ISaid | null {
  const work = jobs.filter(j => j.kind !== 'session');
  const running = work.filter(j => j.running);
  if (running.length) {
    const oldest = running[running.length - 1];
    const many = running.length > 1 ? `${running.length} jobs` : `${oldest.world_size} ranks`;
    return {
      state: 'running',
      text: `elastic: running · ${many} · ${elapsed(model.elapsed(oldest))}`,
      title: running.map(j => `${j.kind} ${j.id} ${j.state}`).join(', ')
    };
  }
  const session = jobs.find(j => j.kind === 'session' && j.running);
  if (session) {
    return {
      state: 'session',
      text: `elastic: session up · ${session.world_size} ranks`,
      title: `session ${session.id} ${session.state}`
    };
  }
  const latest = work[0];
  if (latest && (latest.state === 'failed' || latest.state === 'timeout')) {
    return {
      state: 'failed',
      text: `elastic: ${latest.state}`,
      title: latest.summary ?? `${latest.kind} ${latest.id} ${latest.state}`
    };
  }
  return null;
}
