/**
 * What a person can do to a job from JupyterLab: stop it, see every rank's stack, follow a
 * rank's log. The panel's buttons and the palette's commands both come here.
 */

import { JupyterFrontEnd } from '@jupyterlab/application';
import { Dialog, MainAreaWidget, Notification, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { ApiError, IJob, stopJob } from './api';
import { title } from './format';
import { JobsModel } from './jobs';
import { LogView } from './logs';
import { StacksView } from './stacks';

export class JobActions {
  constructor(
    private readonly _app: JupyterFrontEnd,
    private readonly _model: JobsModel
  ) {}

  /**
   * Stops a job or interrupts a session cell at once; a session is taken down (its ranks and
   * their state end) after the person confirms. Returns whether a stop was asked for.
   */
  async stop(job: IJob): Promise<boolean> {
    if (job.kind === 'session') {
      const answer = await showDialog({
        title: `Take session ${job.id} down?`,
        body: `Its ${job.world_size} ranks end, and with them the state its cells built.`,
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Take down' })]
      });
      if (!answer.button.accept) {
        return false;
      }
    }
    try {
      await stopJob(job.id);
    } catch (error) {
      report(`Could not stop ${title(job)}`, error);
      return false;
    }
    void this._model.refresh();
    return true;
  }

  /** Opens (or refreshes) a tab with every rank's stack side by side. */
  async stacks(job: IJob): Promise<void> {
    const id = `elastic-nb-stacks-${job.id}`;
    let tab = this._find<StacksView>(id);
    if (!tab) {
      const view = new StacksView(job);
      tab = new MainAreaWidget({ content: view });
      tab.id = id;
      tab.title.label = `Stacks · ${title(job)}`;
      tab.title.closable = true;
      tab.toolbar.addItem('dump', view.dumpButton());
      this._app.shell.add(tab, 'main', { mode: 'split-bottom' });
    }
    this._app.shell.activateById(id);
    try {
      await tab.content.dump();
    } catch (error) {
      report(`Could not dump the stacks of ${title(job)}`, error);
    }
  }

  /** Opens a read-only tab that follows one rank's log as it grows. */
  logs(job: IJob, rank: number): void {
    const id = `elastic-nb-log-${job.id}-${rank}`;
    if (!this._find(id)) {
      const view = new LogView(job, rank);
      const tab = new MainAreaWidget({ content: view });
      tab.toolbar.addItem('stream', view.streamPicker());
      tab.id = id;
      tab.title.label = `Log · ${title(job)} · rank ${rank}`;
      tab.title.closable = true;
      this._app.shell.add(tab, 'main', { mode: 'split-bottom' });
    }
    this._app.shell.activateById(id);
  }

  private _find<T extends Widget>(id: string): MainAreaWidget<T> | undefined {
    for (const widget of this._app.shell.widgets('main')) {
      if (widget.id === id) {
        return widget as MainAreaWidget<T>;
      }
    }
    return undefined;
  }
}

/** A failed action, said in JupyterLab's notification area. */
export function report(what: string, error: unknown): void {
  let why = error instanceof Error ? error.message : String(error);
  if (error instanceof ApiError && error.status === 409) {
    why = 'it is not running';
  } else if (error instanceof ApiError && error.status === 404) {
    why = 'no supervisor knows it any more';
  }
  Notification.error(`${what}: ${why}`, { autoClose: 8000 });
}
