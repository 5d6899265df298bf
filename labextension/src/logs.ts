/**
 * A read-only tab that follows one rank's log live: the last lines first, then every new byte,
 * read from the server by offset (the run directory's log is the truth, as for the dashboard).
 */

import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { ILogChunk, IJob, readLog } from './api';
import { plain } from './format';

export const LOG_POLL_MS = 500;
const FIRST_LINES = 500;
/** What the tab holds: the newest characters that fit, in whole chunks (a browser slows past). */
const MAX_CHARS = 1_000_000;
/** Reads per poll while the log is behind (each read is capped by the server). */
const CATCH_UP_READS = 8;

export class LogView extends Widget {
  private _where: HTMLElement;
  private _pre: HTMLPreElement;
  private _chars = 0;
  private _offset: number | null = null;
  private _poll: Poll;

  constructor(
    private readonly _job: IJob,
    private readonly _rank: number
  ) {
    super();
    this.addClass('enb-log-view');
    this._where = document.createElement('div');
    this._where.className = 'enb-log-where';
    this._pre = document.createElement('pre');
    this._pre.className = 'enb-log-text';
    this.node.append(this._where, this._pre);
    this._poll = new Poll({
      factory: () => this._read(),
      frequency: { interval: LOG_POLL_MS, backoff: true, max: 10 * LOG_POLL_MS },
      name: `elastic-nb:log:${_job.id}:${_rank}`,
      standby: () => !this.isVisible || 'when-hidden'
    });
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }

  private async _read(): Promise<void> {
    for (let i = 0; i < CATCH_UP_READS; i++) {
      const from = this._offset === null ? { tail: FIRST_LINES } : { offset: this._offset };
      let chunk: ILogChunk;
      try {
        chunk = await readLog(this._job.id, this._rank, from);
      } catch (error) {
        this._where.textContent = `Cannot read the log: ${error instanceof Error ? error.message : error}`;
        throw error;
      }
      if (this._offset !== null && chunk.size < this._offset) {
        // A new attempt's log replaced the one followed: start again from its tail.
        this._offset = null;
        this._append(`\n── the log restarted (${chunk.path}) ──\n`);
        continue;
      }
      this._offset = chunk.offset;
      this._where.textContent = `rank ${this._rank} · ${chunk.path}`;
      if (chunk.text) {
        this._append(plain(chunk.text));
      }
      if (chunk.offset >= chunk.size) {
        return;
      }
    }
  }

  private _append(text: string): void {
    const node = this.node;
    const atBottom = node.scrollTop + node.clientHeight >= node.scrollHeight - 4;
    this._pre.append(document.createTextNode(text));
    this._chars += text.length;
    while (this._chars > MAX_CHARS && this._pre.firstChild !== this._pre.lastChild) {
      const first = this._pre.firstChild!;
      this._chars -= first.textContent?.length ?? 0;
      first.remove();
    }
    if (atBottom) {
      node.scrollTop = node.scrollHeight;
    }
  }
}
