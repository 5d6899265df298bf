/**
 * The left sidebar's **Elastic jobs** panel: every job, session and session cell of this user's
 * supervisors, running ones first, refreshed every second while the panel is visible. Its
 * buttons reach the supervisor through the Jupyter server, so they work while the kernel that
 * started the job is busy in a blocking `%%elastic` cell.
 */

import { Widget } from '@lumino/widgets';

import { IJob } from './api';
import { JobActions } from './actions';
import { elasticIcon } from './icon';
import { JobCard } from './jobcard';
import { JobsModel } from './jobs';

export class JobsPanel extends Widget {
  private _cards = new Map<string, JobCard>();
  private _list: HTMLUListElement;
  private _note: HTMLElement;

  constructor(
    private readonly _model: JobsModel,
    private readonly _actions: JobActions
  ) {
    super();
    this.id = 'elastic-nb-jobs';
    this.addClass('enb-panel');
    this.title.icon = elasticIcon;
    this.title.caption = 'Elastic jobs';
    const heading = document.createElement('h2');
    heading.className = 'enb-panel-heading';
    heading.textContent = 'Elastic jobs';
    this._note = document.createElement('div');
    this._note.className = 'enb-panel-note';
    this._list = document.createElement('ul');
    this._list.className = 'enb-panel-list';
    this.node.append(heading, this._note, this._list);
    _model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this._model.unwatch(this);
    this._model.changed.disconnect(this._render, this);
    for (const card of this._cards.values()) {
      card.dispose();
    }
    super.dispose();
  }

  protected onAfterShow(): void {
    this._model.watch(this);
  }

  protected onAfterHide(): void {
    this._model.unwatch(this);
  }

  private _render(): void {
    const jobs = [...this._model.jobs].sort(order);
    const seen = new Set(jobs.map(j => j.id));
    for (const [id, card] of this._cards) {
      if (!seen.has(id)) {
        card.dispose();
        this._cards.delete(id);
      }
    }
    jobs.forEach((job, i) => {
      let card = this._cards.get(job.id);
      if (card) {
        card.update(job);
      } else {
        card = new JobCard(job, this._model, this._actions);
        this._cards.set(job.id, card);
      }
      if (this._list.children[i] !== card.node) {
        this._list.insertBefore(card.node, this._list.children[i] ?? null);
      }
    });
    const error = this._model.error;
    this._note.textContent =
      error ??
      (jobs.length
        ? ''
        : 'No elastic jobs. A %%elastic cell, a --bg job or a session (%elastic up) shows here while its kernel lives.');
    this._note.classList.toggle('enb-panel-error', error !== null);
  }
}

/** Running first, then the newest first. */
function order(a: IJob, b: IJob): number {
  if (a.running !== b.running) {
    return a.running ? -1 : 1;
  }
  return b.created - a.created;
}
