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
  private _machines: HTMLElement;

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
    this._machines = document.createElement('section');
    this._machines.className = 'enb-panel-machines';
    this.node.append(heading, this._note, this._list, this._machines);
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
    const jobs = grouped(this._model.jobs);
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
      card.node.classList.toggle(
        'enb-panel-in-session',
        job.kind === 'cell' && jobs.some(j => j.kind === 'session' && j.id === job.session)
      );
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
    this._renderMachines();
  }

  /** The machines of every notebook open to other machines: `%elastic nodes`, for each. */
  private _renderMachines(): void {
    const groups = this._model.machines;
    this._machines.replaceChildren();
    for (const m of groups) {
      const heading = document.createElement('h3');
      heading.className = 'enb-panel-machines-heading';
      heading.textContent = `Machines of ${m.notebook ?? `kernel ${m.kernel_id ?? '?'}`}`;
      const list = document.createElement('ul');
      list.className = 'enb-panel-machine-list';
      for (const n of [m.here, ...m.agents]) {
        const item = document.createElement('li');
        item.className = 'enb-panel-machine';
        item.dataset.state = n.state;
        item.textContent = machineLine(n);
        list.append(item);
      }
      const join = document.createElement('div');
      join.className = 'enb-panel-note';
      join.textContent = `agents join on ${m.listening.host}:${m.listening.port} (%elastic join-command prints the line)`;
      this._machines.append(heading, list, join);
    }
  }
}

/** 'node 1: gpu-b (10.0.0.6) · 8 GPUs · 96 CPUs · torch 2.13.0 · ready, heard 0.2 s ago'. */
export function machineLine(n: {
  node: number;
  name: string;
  addr: string;
  cpus: number;
  gpus: string[];
  torch: string | null;
  cuda: string | null;
  state: string;
  why?: string | null;
  last_heard_s?: number;
  groups?: string[];
}): string {
  const gpus = `${n.gpus.length} GPU${n.gpus.length === 1 ? '' : 's'}`;
  let state = n.state === 'here' ? "the notebook's machine" : n.state;
  if (n.why) {
    state += `: ${n.why}`;
  }
  if (n.state === 'ready' && n.last_heard_s !== undefined) {
    state += `, heard ${n.last_heard_s.toFixed(1)} s ago`;
  }
  if (n.groups?.length) {
    state += `, running ${n.groups.join(', ')}`;
  }
  const torch = `torch ${n.torch ?? '-'}${n.cuda ? ` (CUDA ${n.cuda})` : ''}`;
  return `node ${n.node}: ${n.name} (${n.addr}) · ${gpus} · ${n.cpus} CPUs · ${torch} · ${state}`;
}

/**
 * Running first, then the newest first; a session's cells right under their session (a cell
 * whose session is not listed stands on its own).
 */
export function grouped(jobs: readonly IJob[]): IJob[] {
  const sorted = [...jobs].sort(order);
  const sessions = new Set(sorted.filter(j => j.kind === 'session').map(j => j.id));
  const out: IJob[] = [];
  for (const job of sorted) {
    if (job.kind === 'cell' && job.session !== null && sessions.has(job.session)) {
      continue; // placed under its session
    }
    out.push(job);
    if (job.kind === 'session') {
      out.push(...sorted.filter(j => j.kind === 'cell' && j.session === job.id));
    }
  }
  return out;
}

/** Running first, then the newest first. */
function order(a: IJob, b: IJob): number {
  if (a.running !== b.running) {
    return a.running ? -1 : 1;
  }
  return b.created - a.created;
}
