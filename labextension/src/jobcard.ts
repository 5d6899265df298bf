/**
 * One job in the Elastic jobs panel: what it is and where it came from, its state, world size,
 * restarts, elapsed time and alerts, and its buttons (Stop, Dump stacks, Logs of a rank). A
 * click on its head expands it: then each rank's state and latest line follow the job's events.
 */

import { Poll } from '@lumino/polling';

import { IJob, IJobEvent, jobEvents } from './api';
import { JobActions } from './actions';
import { elapsed, firstLine, origin, title, tone } from './format';
import { JobsModel } from './jobs';

export const EVENTS_POLL_MS = 500;

interface IRankView {
  state: string;
  label: string;
  last: string;
}

export class JobCard {
  readonly node: HTMLLIElement;
  private _job: IJob;
  private _state: HTMLElement;
  private _where: HTMLElement;
  private _facts: HTMLElement;
  private _alerts: HTMLElement;
  private _summary: HTMLElement;
  private _stop: HTMLButtonElement;
  private _stacks: HTMLButtonElement;
  private _rank: HTMLSelectElement;
  private _ranksNode: HTMLElement;
  private _events: Poll | null = null;
  private _seq = 0;
  private _attempt = 0;
  private _ranks = new Map<number, IRankView>();

  constructor(
    job: IJob,
    private readonly _model: JobsModel,
    private readonly _actions: JobActions
  ) {
    this._job = job;
    const el = <K extends keyof HTMLElementTagNameMap>(tag: K, cls: string, text = '') => {
      const e = document.createElement(tag);
      e.className = cls;
      e.textContent = text;
      return e;
    };
    this.node = el('li', 'enb-panel-job');
    this.node.dataset.job = job.id;
    this.node.dataset.kind = job.kind;
    this.node.dataset.session = job.session ?? '';
    const head = el('div', 'enb-panel-head');
    head.title = 'Show each rank';
    head.append(el('span', 'enb-panel-title', title(job)));
    this._state = el('span', 'enb-panel-state');
    head.append(this._state);
    head.addEventListener('click', () => this.toggle());
    this._where = el('div', 'enb-panel-where');
    this._facts = el('div', 'enb-panel-facts');
    this._alerts = el('ul', 'enb-panel-alerts');
    this._summary = el('div', 'enb-panel-summary');

    const actions = el('div', 'enb-panel-actions');
    this._stop = button('Stop', 'enb-panel-stop jp-mod-warn', () => this._actions.stop(this._job));
    this._stacks = button('Dump stacks', 'enb-panel-stacks', () => this._actions.stacks(this._job));
    const logs = button('Logs', 'enb-panel-logs', () =>
      this._actions.logs(this._job, Number(this._rank.value))
    );
    logs.title = "Follow the rank's log in a tab";
    this._rank = el('select', 'enb-panel-rank');
    this._rank.title = 'Which rank';
    actions.append(this._stop, this._stacks, logs, this._rank);
    this._ranksNode = el('ul', 'enb-panel-ranks');
    this.node.append(
      head,
      this._where,
      this._facts,
      this._alerts,
      this._summary,
      actions,
      this._ranksNode
    );
    this.update(job);
  }

  get expanded(): boolean {
    return this._events !== null;
  }

  update(job: IJob): void {
    this._job = job;
    this.node.dataset.state = job.state;
    this.node.dataset.running = String(job.running);
    this._state.textContent = job.state;
    this._state.className = `enb-panel-state enb-panel-s-${tone(job.state)}`;
    this._where.textContent = origin(job);
    this._where.title = job.notebook ?? job.kernel_id ?? '';
    const restarts = job.kind === 'cell' ? '' : ` · restarts ${job.restarts}/${job.max_restarts}`;
    this._facts.textContent =
      `${job.world_size} ranks${restarts} · ${elapsed(this._model.elapsed(job))}` +
      (job.kind === 'cell' && job.session ? ` · session ${job.session}` : '') +
      (job.paused.length ? ` · paused: rank ${job.paused.join(', ')} at a prompt` : '');
    this.node.dataset.paused = String(job.paused.length > 0);
    this._alerts.replaceChildren(
      ...job.alerts.slice(-3).map(a => {
        const li = document.createElement('li');
        li.className = 'enb-panel-alert';
        li.dataset.kind = a.kind;
        li.textContent = `${a.rank === null ? '' : `rank ${a.rank} · `}${firstLine(a.text)}`;
        li.title = a.text;
        return li;
      })
    );
    this._summary.textContent = job.running ? '' : job.summary ?? '';
    this._summary.title = this._summary.textContent;
    this._stop.hidden = this._stacks.hidden = !job.running;
    this._stop.title = {
      job: 'Stop the job: every rank ends',
      session: 'Take the session down: its ranks and their state end',
      cell: "Interrupt this cell on the session's ranks"
    }[job.kind];
    if (this._rank.options.length !== job.world_size) {
      const chosen = this._rank.value;
      this._rank.replaceChildren(
        ...Array.from({ length: job.world_size }, (_, r) => new Option(`rank ${r}`, String(r)))
      );
      this._rank.value = chosen && Number(chosen) < job.world_size ? chosen : '0';
    }
  }

  /** Expanded: each rank's state and latest line, from the job's events (every 0.5 s). */
  toggle(): void {
    if (this._events) {
      this._events.dispose();
      this._events = null;
      this._ranksNode.replaceChildren();
      this.node.classList.remove('enb-panel-expanded');
      return;
    }
    this.node.classList.add('enb-panel-expanded');
    this._events = new Poll({
      factory: () => this._follow(),
      frequency: { interval: EVENTS_POLL_MS, backoff: true, max: 10 * EVENTS_POLL_MS },
      name: `elastic-nb:events:${this._job.id}`,
      standby: 'when-hidden'
    });
  }

  dispose(): void {
    this._events?.dispose();
    this._events = null;
    this.node.remove();
  }

  private async _follow(): Promise<void> {
    const { events, seq } = await jobEvents(this._job.id, this._seq);
    for (const ev of events) {
      this._fold(ev);
    }
    this._seq = seq;
    this._drawRanks();
  }

  private _fold(ev: IJobEvent): void {
    if (ev.attempt !== undefined && ev.attempt > this._attempt) {
      this._attempt = ev.attempt; // a restart: every rank starts over
      this._ranks.clear();
    }
    for (const [rank, chip] of Object.entries(ev.ranks ?? {})) {
      const r = Number(rank);
      const was = this._ranks.get(r);
      this._ranks.set(r, {
        state: chip.state,
        label: chip.label ?? chip.state,
        last: was?.last ?? ''
      });
    }
    for (const batch of ev.logs ?? []) {
      const view = this._ranks.get(batch.rank);
      const last = batch.lines[batch.lines.length - 1];
      if (view && last !== undefined) {
        view.last = last;
      }
    }
  }

  private _drawRanks(): void {
    const ranks = Array.from({ length: this._job.world_size }, (_, r) => r);
    this._ranksNode.replaceChildren(
      ...ranks.map(r => {
        const view = this._ranks.get(r) ?? { state: 'starting', label: 'no news yet', last: '' };
        const li = document.createElement('li');
        li.className = `enb-panel-rank-row enb-panel-s-${tone(view.state)}`;
        li.dataset.rank = String(r);
        li.title = `Follow rank ${r}'s log in a tab`;
        const name = document.createElement('span');
        name.className = 'enb-panel-rank-name';
        name.textContent = `rank ${r}`;
        const label = document.createElement('span');
        label.className = 'enb-panel-rank-label';
        label.textContent = view.label;
        const last = document.createElement('span');
        last.className = 'enb-panel-rank-last';
        last.textContent = view.last;
        li.append(name, label, last);
        li.addEventListener('click', () => this._actions.logs(this._job, r));
        return li;
      })
    );
  }
}

function button(label: string, cls: string, onClick: () => unknown): HTMLButtonElement {
  const b = document.createElement('button');
  b.className = `jp-Button jp-mod-styled jp-mod-small ${cls}`;
  b.textContent = label;
  b.addEventListener('click', event => {
    event.stopPropagation();
    void onClick();
  });
  return b;
}
