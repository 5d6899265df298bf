/**
 * The palette's commands on the current notebook's jobs (its kernel's). Their keyboard shortcut
 * (stop: Accel Alt S) is declared in schema/plugin.json, where a person can change it.
 */

import { JupyterFrontEnd } from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';

import { IJob, listJobs } from './api';
import { JobActions, report } from './actions';

export const CommandIds = {
  showPanel: 'elastic-nb:show-panel',
  stopNotebook: 'elastic-nb:stop-notebook-jobs',
  stacksNotebook: 'elastic-nb:dump-notebook-stacks'
};

export function addCommands(
  app: JupyterFrontEnd,
  palette: ICommandPalette,
  tracker: INotebookTracker,
  actions: JobActions,
  panelId: string
): void {
  const category = 'Elastic';
  const hasNotebook = () => tracker.currentWidget !== null;

  /** The current notebook's jobs, asked of the server now (the poll may be a second old). */
  const notebookJobs = async (): Promise<IJob[]> => {
    const kernel = tracker.currentWidget?.sessionContext.session?.kernel?.id;
    if (!kernel) {
      return [];
    }
    const { jobs } = await listJobs();
    return jobs.filter(j => j.kernel_id === kernel).sort((a, b) => b.created - a.created);
  };

  app.commands.addCommand(CommandIds.showPanel, {
    label: 'Elastic: show the jobs panel',
    execute: () => app.shell.activateById(panelId)
  });

  app.commands.addCommand(CommandIds.stopNotebook, {
    label: 'Elastic: stop the jobs of this notebook',
    caption:
      "Stop every running job of this notebook's kernel and interrupt its running session cell, " +
      'without going through the kernel (its sessions stay up)',
    isEnabled: hasNotebook,
    execute: async () => {
      let running: IJob[];
      try {
        running = (await notebookJobs()).filter(j => j.running && j.kind !== 'session');
      } catch (error) {
        report('Could not list the elastic jobs', error);
        return;
      }
      if (!running.length) {
        Notification.info('No elastic job of this notebook is running.', { autoClose: 4000 });
        return;
      }
      const stopped = await Promise.all(running.map(j => actions.stop(j)));
      const names = running.filter((_, i) => stopped[i]).map(j => `${j.kind} ${j.id}`);
      if (names.length) {
        Notification.info(`Stopping ${names.join(', ')}`, { autoClose: 4000 });
      }
    }
  });

  app.commands.addCommand(CommandIds.stacksNotebook, {
    label: "Elastic: dump stacks of this notebook's running job",
    caption: 'Every rank of the running job (or session) shows where it is, side by side',
    isEnabled: hasNotebook,
    execute: async () => {
      let jobs: IJob[];
      try {
        jobs = (await notebookJobs()).filter(j => j.running);
      } catch (error) {
        report('Could not list the elastic jobs', error);
        return;
      }
      // A running job or session cell, else a session that is up (between cells).
      const job = jobs.find(j => j.kind !== 'session') ?? jobs[0];
      if (!job) {
        Notification.info('No elastic job of this notebook is running.', { autoClose: 4000 });
        return;
      }
      await actions.stacks(job);
    }
  });

  for (const command of Object.values(CommandIds)) {
    palette.addItem({ command, category });
  }
}
