/**
 * Every rank's Python stack, side by side (as the dashboard's stacks alert shows them): one
 * column per rank, so that where each rank waits can be read across.
 */

import { ToolbarButton, refreshIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { IJob, IStacks, dumpStacks } from './api';
import { title } from './format';

export class StacksView extends Widget {
  private _when: HTMLElement;
  private _grid: HTMLElement;

  constructor(private readonly _job: IJob) {
    super();
    this.addClass('enb-stacks-view');
    this._when = document.createElement('div');
    this._when.className = 'enb-stacks-when';
    this._grid = document.createElement('div');
    this._grid.className = 'enb-stacks-grid';
    this.node.append(this._when, this._grid);
  }

  /** Asks every live rank of the job for its stack now, and shows them. */
  async dump(): Promise<void> {
    this._when.textContent = `Asking every rank of ${title(this._job)} for its stack...`;
    try {
      this._render(await dumpStacks(this._job.id));
    } catch (error) {
      this._when.textContent = `No stacks: ${error instanceof Error ? error.message : error}`;
      throw error;
    }
  }

  /** The tab's toolbar button that dumps again. */
  dumpButton(): ToolbarButton {
    return new ToolbarButton({
      icon: refreshIcon,
      label: 'Dump again',
      tooltip: 'Ask every rank for its stack again',
      onClick: () => void this.dump().catch(() => undefined)
    });
  }

  private _render(stacks: IStacks): void {
    const ranks = [...stacks.ranks].sort((a, b) => a.rank - b.rank);
    this._when.textContent =
      `${title(this._job)} · ${ranks.length} ranks · ` +
      `stacks taken at ${new Date().toLocaleTimeString()}`;
    this._grid.replaceChildren(
      ...ranks.map(r => {
        const column = document.createElement('section');
        column.className = 'enb-stacks-rank';
        column.dataset.rank = String(r.rank);
        const head = document.createElement('h3');
        head.textContent = r.pid === null ? `rank ${r.rank}` : `rank ${r.rank} · pid ${r.pid}`;
        const pre = document.createElement('pre');
        pre.textContent = r.text;
        column.append(head, pre);
        return column;
      })
    );
    if (ranks.length === 0) {
      const pre = document.createElement('pre');
      pre.textContent = stacks.text;
      this._grid.append(pre);
    }
  }
}
