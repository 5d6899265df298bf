/**
 * The jobs of this user's supervisors, polled from the server once a second while anything
 * shows them: the sidebar panel while it is visible, a notebook's toolbar indicator while the
 * notebook is open. Nobody watching, no requests.
 */

import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { ApiError, IJob, IMachines, listJobs } from './api';

/** The poll interval: a panel that says "running" is at most this late. */
export const POLL_MS = 1000;

export class JobsModel {
  private _jobs: IJob[] = [];
  private _machines: IMachines[] = [];
  private _fetchedAt = 0;
  private _error: string | null = null;
  private _watchers = new Set<object>();
  private _changed = new Signal<this, void>(this);
  private _poll: Poll;

  constructor() {
    this._poll = new Poll({
      auto: false,
      factory: () => this._fetch(),
      // Backoff applies to failures only: a server without the extension is asked less often.
      frequency: { interval: POLL_MS, backoff: true, max: 10 * POLL_MS },
      name: 'elastic-nb:jobs',
      standby: () => this._watchers.size === 0 || 'when-hidden'
    });
  }

  /** Emitted after every poll (the jobs, their elapsed times or the error may have changed). */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get jobs(): readonly IJob[] {
    return this._jobs;
  }

  /** The machines of every notebook open to other machines (its join agents). */
  get machines(): readonly IMachines[] {
    return this._machines;
  }

  /** Why the last poll failed, or null. */
  get error(): string | null {
    return this._error;
  }

  /** A job's elapsed time now: what the server said, plus the time since (when running). */
  elapsed(job: IJob): number {
    return job.running ? job.elapsed_s + (Date.now() - this._fetchedAt) / 1000 : job.elapsed_s;
  }

  /** The jobs started from one kernel, newest first. */
  ofKernel(kernelId: string | null | undefined): IJob[] {
    if (!kernelId) {
      return [];
    }
    return this._jobs.filter(j => j.kernel_id === kernelId).sort((a, b) => b.created - a.created);
  }

  find(id: string): IJob | undefined {
    return this._jobs.find(j => j.id === id);
  }

  /** Starts polling for `watcher` (at once) until it calls `unwatch`. */
  watch(watcher: object): void {
    const first = this._watchers.size === 0;
    this._watchers.add(watcher);
    if (first) {
      void this._poll.start().then(() => this._poll.refresh());
    }
  }

  unwatch(watcher: object): void {
    this._watchers.delete(watcher);
  }

  /** Polls now (after a Stop, so the panel shows "stopping" at once). */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  dispose(): void {
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _fetch(): Promise<void> {
    try {
      const listed = await listJobs();
      this._jobs = listed.jobs;
      this._machines = listed.machines;
      this._fetchedAt = Date.now();
      this._error = null;
    } catch (error) {
      this._error =
        error instanceof ApiError && error.status === 404
          ? 'The elastic_nb server extension is not enabled on this Jupyter server.'
          : `${error instanceof Error ? error.message : error}`;
      this._changed.emit();
      throw error; // the poll backs off
    }
    this._changed.emit();
  }
}
